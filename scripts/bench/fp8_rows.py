"""fp8 quantization of one forward's rows on the GPU: format.quantize_rows (PyTorch, several
passes) against fp8_rows.quantize_rows (one kernel), device time per forward.

    python -m scripts.bench.fp8_rows --out FILE.json [--tokens 16384] [--layers 3] [--hidden-size 7168]

A forward's rows are `tokens` rows of `layers` states plus the last hidden state, as the dump
quantizes them (the gpu-rank preset: 16384 tokens, the largest prefill, 3 layers at width
7168). Each quantizer runs `--repeats` times after a warm-up, timed with CUDA events; the
result is the median, and the bytes of device memory each pass reads and writes by design.
"""

import argparse
import json
import statistics

import torch


def time_ms(function, repeats: int) -> list:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from sglang.srt.hidden_states_dump import format, fp8_rows

    states = torch.randn(args.tokens, args.layers, args.hidden_size, device="cuda", dtype=torch.bfloat16)
    last = torch.randn(args.tokens, args.hidden_size, device="cuda", dtype=torch.bfloat16)
    rows = {"hidden_states": states, "last_hidden_state": last}
    elements = states.numel() + last.numel()
    results = {"tokens": args.tokens, "layers": args.layers, "hidden_size": args.hidden_size,
               "device": torch.cuda.get_device_name(), "quantizers": {}}
    # Bytes each element costs in device memory, by the passes each makes: PyTorch's min/max
    # reads 2, its division reads 2 and writes a float32 4, its cast reads 4 and writes 1;
    # the kernel reads 2 and writes 1.
    for name, quantize, bytes_per_element in (("pytorch", format.quantize_rows, 13),
                                              ("kernel", fp8_rows.quantize_rows, 3)):
        run = lambda: format.quantize_file_rows(rows, quantize)
        time_ms(run, 3)  # warm-up (the kernel compiles on its first call)
        times = time_ms(run, args.repeats)
        median = statistics.median(times)
        results["quantizers"][name] = {
            "median_ms": median, "min_ms": min(times), "max_ms": max(times), "times_ms": times,
            "designed_bytes": elements * bytes_per_element,
            "designed_gb_per_s": elements * bytes_per_element / median / 1e6,
        }
        print(f"{name}: {median:.3f} ms a forward ({min(times):.3f}-{max(times):.3f}), "
              f"{elements * bytes_per_element / median / 1e6:.0f} GB/s of designed traffic")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
