"""Is the generate command the bottleneck? Its prompt tokens/s against the benchmarks' raw
concurrent sender (scripts.bench.measure.send_and_land) on the same prompts and server.

    python -m scripts.bench.generate [--rounds 3] [--conversations 64] --out results/bench-generate-cpu.json

One dumping server on the tiny model. Each round builds new conversations (so no prompt
repeats), tokenizes them once with the model's chat template for the raw sender, then
runs both, in alternating order: the raw sender sends the token ids (64 at once, no rid) and waits for their
manifest lines; generate runs its whole path on the same conversations as a JSON Lines
dataset (read, template, loss mask, send with the same concurrency, wait for the manifest,
samples.jsonl), timed from its first record to its last samples line. Both count the same
prompt tokens. Nothing here asserts timings.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from scripts.bench.dump import SERVER_ARGS
from scripts.bench.measure import send_and_land, summary
from scripts.dumps.chat import ChatEncoder, load_tokenizer
from scripts.dumps.conversations import open_dataset
from scripts.dumps.generate import Client, Endpoint, Generation
from scripts.dumps.server import Server, runtime_env
from scripts.dumps.tiny_model import ensure_model
from scripts.dumps.tiny_tokenizer import CORPUS

CONCURRENCY = 64  # send_all's pool


def conversations(count: int, seed: int):
    sentences = [s.strip() + "." for s in CORPUS.read_text().replace("\n", " ").split(". ") if len(s) > 20]
    rng = random.Random(seed)
    for n in range(count):
        turns = []
        for _ in range(3):
            turns.append({"role": "user", "content": " ".join(rng.sample(sentences, 2))})
            turns.append({"role": "assistant", "content": " ".join(rng.sample(sentences, 4))})
        yield {"id": f"bench-{seed}-{n}", "messages": turns}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    model = ensure_model(layers=args.layers)
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    dump = work / "dump"
    encoder = ChatEncoder(load_tokenizer(model))
    results = {"model": str(model), "conversations": args.conversations, "concurrency": CONCURRENCY, "rounds": []}
    with Server(model, work / "server.log", runtime_env(SGLANG_HS_DUMP_DIR=str(dump)), list(SERVER_ARGS)) as server:
        server.wait_ready()
        client = Client(f"http://127.0.0.1:{server.port}")
        for round_number in range(args.rounds):
            records = list(conversations(args.conversations, seed=round_number))
            prompts = [encoder.encode(record["messages"])[0] for record in records]
            tokens = sum(map(len, prompts))
            dataset_path = work / f"round-{round_number}.jsonl"
            dataset_path.write_text("".join(json.dumps(record) + "\n" for record in records))

            def generate():
                generation = Generation([Endpoint(client)], dump, encoder, None, "", CONCURRENCY, retries=0, manifest_timeout=120)
                started = time.perf_counter()
                tally = generation.run(open_dataset(dataset_path), None)
                assert tally.complete and tally.tokens == tokens, (tally, tokens)
                return time.perf_counter() - started

            # Who goes first alternates, so a neighbour's load hits both alike over the rounds.
            if round_number % 2:
                generate_seconds, raw_seconds = generate(), send_and_land(server, prompts, dump)
            else:
                raw_seconds, generate_seconds = send_and_land(server, prompts, dump), generate()
            round_result = {"tokens": tokens, "raw_tokens_per_s": tokens / raw_seconds,
                            "generate_tokens_per_s": tokens / generate_seconds}
            round_result["ratio"] = round_result["generate_tokens_per_s"] / round_result["raw_tokens_per_s"]
            results["rounds"].append(round_result)
            print(f"round {round_number}: {tokens} tokens; raw {round_result['raw_tokens_per_s']:,.0f} tok/s, "
                  f"generate {round_result['generate_tokens_per_s']:,.0f} tok/s, ratio {round_result['ratio']:.3f}",
                  flush=True)
    for key in ("raw_tokens_per_s", "generate_tokens_per_s", "ratio"):
        results[key] = summary([r[key] for r in results["rounds"]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"generate / raw sender: median {statistics.median(r['ratio'] for r in results['rounds']):.3f} "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
