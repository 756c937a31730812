"""What pinned host buffers cost the dump per forward, cold and warm.

    python -m scripts.bench.pinned [--hidden-size 7168] [--forwards 400] --out FILE.json

The dump takes each forward's rows into pinned host buffers and copies them there on
its own CUDA stream; the writer threads drop them once written. This replays that
pattern without a model or a server: forwards of mixed sizes (the token counts a
prefill batch has, EAGLE-3's three layers plus the final state in bf16 and the token
ids), each forward's buffers held until `--in-flight` later forwards have been taken
(the queue and the writers), and times every allocation, for two contenders: a new
`torch.empty(..., pin_memory=True)` per forward (PyTorch's caching host allocator) and
the dump's own HostBuffers, whose reserve is pinned once before the first forward (sized
for `--in-flight` forwards of the largest size, plus one; its pinning time is reported
apart). Needs a CUDA device and the patched SGLang on PYTHONPATH.
"""

import argparse
import collections
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

FORWARD_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)
STATES = 4  # three captured layers and the final state


def allocation_seconds(hidden_size: int, forwards: int, in_flight: int, pooled: bool, seed: int = 0) -> dict:
    """Each forward's allocation time, the reserve's pinning time and the overflows."""
    from sglang.srt.hidden_states_dump.host_buffers import HostBuffers

    rng = random.Random(seed)
    started = time.perf_counter()
    largest = max(FORWARD_TOKENS) * (8 + STATES * hidden_size * 2)
    pool = HostBuffers(reserve_bytes=(in_flight + 1) * largest if pooled else 0, pin_memory=True)
    reserve_seconds = time.perf_counter() - started
    stream = torch.cuda.Stream()
    device_rows = torch.randn(max(FORWARD_TOKENS), STATES, hidden_size, device="cuda").to(torch.bfloat16)
    device_ids = torch.zeros(max(FORWARD_TOKENS), dtype=torch.int64, device="cuda")
    held = collections.deque()
    seconds = []
    for _ in range(forwards):
        tokens = rng.choice(FORWARD_TOKENS)
        source = {"token_ids": device_ids[:tokens], "hidden_states": device_rows[:tokens, :-1],
                  "last_hidden_state": device_rows[:tokens, -1]}
        started = time.perf_counter()
        if pooled:
            rows = pool.rows(source)
            host = {name: getattr(rows, name) for name in source}
        else:
            host = {name: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    for name, t in source.items()}
        seconds.append(time.perf_counter() - started)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for name, tensor in source.items():
                host[name].copy_(tensor, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        held.append((ready, rows if pooled else host))
        del host
        if len(held) > in_flight:
            done, _ = held.popleft()  # written: the writer lets go of its rows
            done.synchronize()
    torch.cuda.synchronize()
    return {"seconds": seconds, "reserve_seconds": reserve_seconds, "overflows": pool.overflows}


CONTENDERS = {"torch.empty(pin_memory=True) per forward": False, "HostBuffers reserve pinned at startup": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--forwards", type=int, default=400)
    parser.add_argument("--in-flight", type=int, default=16, help="forwards whose buffers are held at once")
    parser.add_argument("--contender", choices=sorted(CONTENDERS), help="run only this one, in this process")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.contender:
        measured = allocation_seconds(args.hidden_size, args.forwards, args.in_flight, CONTENDERS[args.contender])
        args.out.write_text(json.dumps(measured))
        return 0
    ms = lambda values: {"median": statistics.median(values) * 1e3, "max": max(values) * 1e3,
                         "total": sum(values) * 1e3, "count": len(values)}
    cold = 2 * args.in_flight
    allocation_ms = {}
    for name in CONTENDERS:  # each in a process of its own: no pinned blocks cached by the other
        part = args.out.with_suffix(".part")
        subprocess.run([sys.executable, "-m", "scripts.bench.pinned", "--contender", name, "--out", str(part),
                        "--hidden-size", str(args.hidden_size), "--forwards", str(args.forwards),
                        "--in-flight", str(args.in_flight)], check=True)
        measured = json.loads(part.read_text())
        part.unlink()
        seconds = measured["seconds"]
        allocation_ms[name] = {"first forwards (cold)": ms(seconds[:cold]), "later forwards (warm)": ms(seconds[cold:])}
        if CONTENDERS[name]:
            allocation_ms[name]["pinning the reserve at startup"] = measured["reserve_seconds"] * 1e3
            allocation_ms[name]["overflows"] = measured["overflows"]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden_size": args.hidden_size,
              "forward_tokens": FORWARD_TOKENS, "in_flight": args.in_flight, "allocation_ms": allocation_ms}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
