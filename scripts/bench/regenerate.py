"""What having the target write the answers costs: the generate command on the same chat dataset,
plainly (the dataset's answers dumped as written) and with --regenerate (each assistant turn
written by the served model first, then the conversations it wrote dumped), on one dumping
server of the tiny model, rounds alternating.

    python -m scripts.bench.regenerate [--rounds 3] [--conversations 32] [--max-new-tokens 64] --out FILE.json

Each way has its own server, whose dump folder is that way's output folder (generate reads the
manifest there); the servers sleep when idle, so the one not measured leaves the cores alone.
Each round builds new three-turn conversations (scripts/bench/generate.py's; new ids, so
nothing resumes) and times each command from its start to its exit (its last samples line
written). Reported per way: seconds, conversations/s, dumped tokens/s and, for --regenerate,
the tokens the model wrote. Nothing here asserts timings."""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.dump import SERVER_ARGS
from scripts.bench.generate import conversations
from scripts.bench.measure import summary
from scripts.dumps.server import Server, runtime_env
from scripts.dumps.tiny_model import ensure_model

WAYS = ("plain", "regenerate")


def run_generate(model: Path, server: Server, dataset: Path, out: Path, regenerate: bool, max_new_tokens: int) -> dict:
    command = [sys.executable, "-m", "scripts.dumps.generate", "--dataset", str(dataset), "--out", str(out),
               "--model", str(model), "--server", server.url, "--concurrency", "16"]
    if regenerate:
        command += ["--regenerate", "--max-new-tokens", str(max_new_tokens), "--temperature", "0.7", "--seed", "1"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise RuntimeError(f"generate exited {done.returncode}: {done.stderr[-2000:]}")
    ids = {json.loads(line)["id"] for line in dataset.read_text().splitlines()}
    samples = [s for s in map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if s["rid"] in ids]
    if len(samples) != len(ids):
        raise RuntimeError(f"{len(samples)} samples of {len(ids)} conversations in {out}")
    return {"seconds": seconds, "samples": len(samples), "tokens": sum(s["num_tokens"] for s in samples)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    model = ensure_model(layers=4)
    results = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-regenerate-") as work:
        work = Path(work)
        servers = {way: Server(model, work / f"server-{way}.log", runtime_env(SGLANG_HS_DUMP_DIR=str(work / way)),
                               list(SERVER_ARGS)).start() for way in WAYS}
        with servers["plain"], servers["regenerate"]:
            for server in servers.values():
                server.wait_ready()
            for round_index in range(-1, args.rounds):  # round -1 warms up and is not kept
                dataset = work / f"round-{round_index}.jsonl"
                dataset.write_text("".join(json.dumps(c) + "\n"
                                           for c in conversations(args.conversations, seed=4000 + round_index)))
                order = WAYS if round_index % 2 == 0 else WAYS[::-1]
                for way in order:
                    result = run_generate(model, servers[way], dataset, work / way, way == "regenerate",
                                          args.max_new_tokens)
                    if round_index >= 0:
                        results[way].append(result)
                        print(f"round {round_index + 1}: {way} {result['seconds']:.1f}s", flush=True)
    report = {
        way: {"seconds": summary([r["seconds"] for r in rounds]),
              "conversations_per_s": summary([r["samples"] / r["seconds"] for r in rounds]),
              "dumped_tokens_per_s": summary([r["tokens"] / r["seconds"] for r in rounds]),
              "dumped_tokens": [r["tokens"] for r in rounds]}
        for way, rounds in results.items()}
    report["regenerate_over_plain"] = summary([r["seconds"] / p["seconds"]
                                               for r, p in zip(results["regenerate"], results["plain"])])
    report["workload"] = (f"{args.conversations} conversations of three user and three assistant turns a round, "
                          f"--regenerate --max-new-tokens {args.max_new_tokens} --temperature 0.7; one server, "
                          f"generate --concurrency 16")
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v["seconds"]["median"] if isinstance(v, dict) and "seconds" in v else v
                      for k, v in report.items() if k != "workload"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
