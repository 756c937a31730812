"""Does a pinned host buffer per forward cost the dump anything once the server is warm?

    python -m scripts.bench.pinned [--hidden-size 7168] [--forwards 400] --out FILE.json

The dump takes each forward's rows into new pinned host buffers (`torch.empty(...,
pin_memory=True)`) and copies them there on its own CUDA stream; the writer threads drop
them once written. This replays that pattern without a model or a server: forwards of
mixed sizes (the token counts a prefill batch has, EAGLE-3's three layers plus the final
state in bf16 and the token ids), each buffer held until `--in-flight` later forwards
have been taken (the queue and the writers), and times every allocation. If PyTorch's
caching host allocator serves later forwards from the blocks earlier ones freed, only
the first forwards pay for pinning, and a pool of our own would save nothing.
Needs a CUDA device.
"""

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

FORWARD_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)
STATES = 4  # three captured layers and the final state


def allocation_seconds(hidden_size: int, forwards: int, in_flight: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    stream = torch.cuda.Stream()
    device_rows = torch.randn(max(FORWARD_TOKENS), STATES, hidden_size, device="cuda").to(torch.bfloat16)
    held = collections.deque()
    seconds = []
    for _ in range(forwards):
        tokens = rng.choice(FORWARD_TOKENS)
        source = device_rows[:tokens]
        started = time.perf_counter()
        host = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=True)
        ids = torch.empty(tokens, dtype=torch.int64, device="cpu", pin_memory=True)
        seconds.append(time.perf_counter() - started)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)
            ids.fill_(0)
            ready = torch.cuda.Event()
            ready.record(stream)
        held.append((ready, host, ids))
        if len(held) > in_flight:
            done, _, _ = held.popleft()  # written: the writer lets go of its rows
            done.synchronize()
    torch.cuda.synchronize()
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--forwards", type=int, default=400)
    parser.add_argument("--in-flight", type=int, default=16, help="forwards whose buffers are held at once")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    seconds = allocation_seconds(args.hidden_size, args.forwards, args.in_flight)
    first = seconds[: 2 * args.in_flight]
    rest = seconds[2 * args.in_flight:]
    ms = lambda values: {"median": statistics.median(values) * 1e3, "max": max(values) * 1e3,
                         "total": sum(values) * 1e3, "count": len(values)}
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden_size": args.hidden_size,
              "forward_tokens": FORWARD_TOKENS, "in_flight": args.in_flight,
              "allocation_ms": {"first forwards (cold)": ms(first), "later forwards (warm)": ms(rest)}}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
