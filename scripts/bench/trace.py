"""Summaries of a torch profiler trace (the chrome-trace JSON SGLang's /start_profile writes):
what the GPU did over the profiled forwards, per stream, and what the host threads spent in
CUDA runtime calls. The trace suite of scripts/bench/dump.py compares a dumping server's
summary with dump off's: whether the forwards' kernels got slower, the forward stream sat
idle, or a host thread waited."""

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

TOP = 12  # kernels and runtime calls listed by total time
GAP_US = 1000  # idle stretches of the forward stream counted as gaps


def busy_us(intervals: List[Tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        events = [e for e in json.load(handle).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"gpu_events": 0}
    spans = lambda items: [(e["ts"], e["ts"] + e["dur"]) for e in items]
    by_stream = defaultdict(list)
    for event in gpu:
        by_stream[str(event.get("args", {}).get("stream", "?"))].append(event)
    streams: Dict[str, dict] = {}
    for stream, items in by_stream.items():
        memcpy = defaultdict(lambda: [0, 0.0, 0])  # kind: [count, us, bytes]
        for event in items:
            if event["cat"] == "gpu_memcpy":
                entry = memcpy[event["name"]]
                entry[0] += 1
                entry[1] += event["dur"]
                entry[2] += event.get("args", {}).get("bytes", 0)
        streams[stream] = {
            "kernels": sum(e["cat"] == "kernel" for e in items),
            "kernel_us": round(sum(e["dur"] for e in items if e["cat"] == "kernel")),
            "busy_us": round(busy_us(spans(items))),
            "memcpy": {name: {"count": c, "us": round(us), "GB/s": round(b / us / 1e3, 2) if us else None}
                       for name, (c, us, b) in memcpy.items()},
        }
    kernels = defaultdict(lambda: [0, 0.0])
    runtime = defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.get("cat") == "kernel":
            entry = kernels[event["name"][:90]]
        elif event.get("cat") in ("cuda_runtime", "cuda_driver"):
            entry = runtime[f"{event['name']} (tid {event.get('tid')})"]
        else:
            continue
        entry[0] += 1
        entry[1] += event["dur"]
    # The forward stream: the one with the most kernel time. Its idle stretches, each named
    # by what ran when it resumed (a copy waiting for the copy engine shows as a memcpy).
    forward = max(streams, key=lambda stream: streams[stream]["kernel_us"])
    gaps = defaultdict(lambda: [0, 0.0])
    reach = None
    for event in sorted(by_stream[forward], key=lambda e: e["ts"]):
        if reach is not None and event["ts"] - reach > GAP_US:
            gaps[event["name"][:60]][0] += 1
            gaps[event["name"][:60]][1] += event["ts"] - reach
        reach = max(reach or event["ts"], event["ts"] + event["dur"])
    top = lambda table: {name: {"count": c, "us": round(us)}
                         for name, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:TOP]}
    return {"gpu_span_us": round(max(end for _, end in spans(gpu)) - min(e["ts"] for e in gpu)),
            "gpu_busy_us": round(busy_us(spans(gpu))),
            "streams": streams, "forward_stream": forward,
            f"forward_stream_gaps_over_{GAP_US}us_by_what_resumed": top(gaps), "kernels_by_time": top(kernels),
            "runtime_calls_by_time": top(runtime)}
