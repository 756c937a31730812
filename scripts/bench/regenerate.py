"""The regenerate suite: what having the target write the answers costs. The generate command
on the same chat dataset, plainly (the dataset's answers dumped as written) and with
--regenerate (each assistant turn written by the served model first, then the conversations it
wrote dumped), rounds alternating which way goes first.

    python -m scripts.bench.dump --suite regenerate [--preset cpu|gpu-traffic] --out FILE.json

Each way has its own server of the preset's model, whose dump folder is that way's output
folder (generate reads the manifest there); the servers sleep when idle, so the one not
measured leaves the cores alone. Each round builds new three-turn conversations
(scripts/bench/generate.py's; new ids, so nothing resumes) and times each command from its
start to its exit (its last samples line written). Reported per way: seconds, conversations/s,
dumped tokens/s. Nothing here asserts timings."""

import json
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench.generate import conversations
from scripts.bench.measure import summary

WAYS = ("plain", "regenerate")


def run_generate(run, server, dataset: Path, out: Path, regenerate: bool, load: dict) -> dict:
    command = [sys.executable, "-m", "scripts.dumps.generate", "--dataset", str(dataset), "--out", str(out),
               "--model", str(run.model), "--server", server.url, "--concurrency", str(load["concurrency"])]
    if regenerate:
        command += ["--regenerate", "--max-new-tokens", str(load["max_new_tokens"]), "--temperature", "0.7",
                    "--seed", "1"]
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


def suite_regenerate(run) -> dict:
    load = run.preset["regenerate"]
    results = {way: [] for way in WAYS}

    def report() -> dict:
        rounds = min(len(values) for values in results.values())
        done = {way: values[:rounds] for way, values in results.items()}
        return {
            **{way: {"seconds": summary([r["seconds"] for r in values]),
                     "conversations_per_s": summary([r["samples"] / r["seconds"] for r in values]),
                     "dumped_tokens_per_s": summary([r["tokens"] / r["seconds"] for r in values]),
                     "dumped_tokens": [r["tokens"] for r in values]} for way, values in done.items() if values},
            "regenerate_over_plain": summary([r["seconds"] / p["seconds"]
                                              for r, p in zip(done["regenerate"], done["plain"])]) if rounds else None,
            "rounds": rounds,
            "workload": (f"{load['conversations']} conversations of three user and three assistant turns a round, "
                         f"--regenerate --max-new-tokens {load['max_new_tokens']} --temperature 0.7; "
                         f"generate --concurrency {load['concurrency']}")}

    servers = {way: run.start_server(f"regenerate-{way}", {"SGLANG_HS_DUMP_DIR": str(run.work / way)})
               for way in WAYS}
    with servers["plain"], servers["regenerate"]:
        for server in servers.values():
            server.wait_ready()
        for round_index in [-1, *run.rounds()]:  # round -1 warms up and is not kept
            dataset = run.work / f"regenerate-round-{round_index}.jsonl"
            dataset.write_text("".join(json.dumps(c) + "\n"
                                       for c in conversations(load["conversations"], seed=4000 + round_index)))
            for way in WAYS if round_index % 2 == 0 else WAYS[::-1]:
                result = run_generate(run, servers[way], dataset, run.work / way, way == "regenerate", load)
                if round_index >= 0:
                    results[way].append(result)
            if round_index >= 0:
                run.checkpoint(report())
                run.progress(f"regenerate: round {round_index + 1}: " + ", ".join(
                    f"{way} {values[-1]['seconds']:.1f}s" for way, values in results.items()))
    return report()
