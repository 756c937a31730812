"""Is the generate command the bottleneck? Its rate against raw concurrent senders, each
pinned to one server, on the same prompts and servers.

    python -m scripts.bench.generate [--servers 2] [--rounds 3] [--conversations 64] --out results/bench-generate-cpu.json

--servers dumping servers on the tiny model, all into one directory, each under its own
writer id. Each round builds new conversations (so no prompt repeats), tokenizes them once
with the model's chat template for the raw senders, then runs both, in alternating order:
one raw sender per server sends its share of the token ids (every n-th prompt, 64 at once,
side by side with the other senders) and waits for the manifest to list each of its files;
generate runs its whole path over all the servers on the same conversations as a JSON Lines
dataset (read, template, loss mask, up to 64 in flight per server, wait for the manifest,
samples.jsonl), timed from its first record to its last samples line. The raw rate is the
sum of the senders' own rates (samples, or prompt tokens, over the seconds until their last
file landed). Nothing here asserts timings.
"""

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import List

from scripts.bench.measure import send_all, summary
from scripts.bench.run import SERVER_ARGS
from scripts.dump_format import ManifestFollower
from scripts.dumps.chat import ChatEncoder, load_tokenizer
from scripts.dumps.conversations import open_dataset
from scripts.dumps.generate import Client, Endpoint, Generation
from scripts.dumps.server import Server, runtime_env
from scripts.dumps.tiny_model import ensure_model
from scripts.dumps.tiny_tokenizer import CORPUS

CONCURRENCY = 64  # requests in flight per server, for both clients


def conversations(count: int, seed: int):
    sentences = [s.strip() + "." for s in CORPUS.read_text().replace("\n", " ").split(". ") if len(s) > 20]
    rng = random.Random(seed)
    for n in range(count):
        turns = []
        for _ in range(3):
            turns.append({"role": "user", "content": " ".join(rng.sample(sentences, 2))})
            turns.append({"role": "assistant", "content": " ".join(rng.sample(sentences, 4))})
        yield {"id": f"bench-{seed}-{n}", "messages": turns}


def pinned_senders(servers: List[Server], prompts: List[List[int]], dump: Path, tag: str,
                   timeout: float = 600) -> List[float]:
    """Seconds until each server's raw sender, all running side by side, has its last file
    listed by the manifest; sender i sends prompts i, i + len(servers), ... to server i."""
    follower = ManifestFollower(str(dump))
    follower.poll()
    rids = [f"{tag}-{n}" for n in range(len(prompts))]
    shares = [range(i, len(prompts), len(servers)) for i in range(len(servers))]
    waiting = [{rids[n] for n in share} for share in shares]
    landed = [0.0] * len(servers)

    def send(server: Server, share) -> None:
        send_all(server, [prompts[n] for n in share], rids=[rids[n] for n in share])

    started = time.perf_counter()
    senders = [threading.Thread(target=send, args=pair) for pair in zip(servers, shares)]
    for sender in senders:
        sender.start()
    while any(waiting):
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"{dump}: {sum(map(len, waiting))} files not listed after {timeout}s")
        time.sleep(0.002)
        arrived = {entry["rid"] for entry in follower.poll()}
        for i, rest in enumerate(waiting):
            if rest:
                rest.difference_update(arrived)
                if not rest:
                    landed[i] = time.perf_counter() - started
    for sender in senders:
        sender.join()
    return landed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=1, help="dumping servers, each its own raw sender")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    model = ensure_model(layers=args.layers)
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    dump = work / "dump"
    encoder = ChatEncoder(load_tokenizer(model))
    results = {"model": model.name, "servers": args.servers, "conversations": args.conversations,
               "concurrency_per_server": CONCURRENCY, "rounds": []}
    with ExitStack() as stack:
        servers = [stack.enter_context(Server(model, work / f"server-{n}.log",
                                              runtime_env(SGLANG_HS_DUMP_DIR=str(dump), SGLANG_HS_DUMP_WRITER_ID=f"s{n}"),
                                              list(SERVER_ARGS)))
                   for n in range(args.servers)]
        for server in servers:
            server.wait_ready()
        endpoints = [Endpoint(Client(server.url)) for server in servers]
        for round_number in range(args.rounds):
            records = list(conversations(args.conversations, seed=round_number))
            prompts = [encoder.encode(record["messages"])[0] for record in records]
            tokens = sum(map(len, prompts))
            dataset_path = work / f"round-{round_number}.jsonl"
            dataset_path.write_text("".join(json.dumps(record) + "\n" for record in records))

            def generate():
                generation = Generation(endpoints, dump, encoder, None, "", CONCURRENCY, retries=0, manifest_timeout=120)
                started = time.perf_counter()
                tally = generation.run(open_dataset(dataset_path), None)
                assert tally.complete and tally.tokens == tokens, (tally, tokens)
                return time.perf_counter() - started

            def raw():
                landed = pinned_senders(servers, prompts, dump, tag=f"raw-{round_number}")
                shares = [prompts[i::len(servers)] for i in range(len(servers))]
                return (sum(len(share) / seconds for share, seconds in zip(shares, landed)),
                        sum(sum(map(len, share)) / seconds for share, seconds in zip(shares, landed)))

            # Who goes first alternates, so a neighbour's load hits both alike over the rounds.
            if round_number % 2:
                generate_seconds, (raw_samples, raw_tokens) = generate(), raw()
            else:
                (raw_samples, raw_tokens), generate_seconds = raw(), generate()
            round_result = {"samples": len(prompts), "tokens": tokens,
                            "raw_samples_per_s": raw_samples, "generate_samples_per_s": len(prompts) / generate_seconds,
                            "raw_tokens_per_s": raw_tokens, "generate_tokens_per_s": tokens / generate_seconds}
            round_result["ratio"] = round_result["generate_samples_per_s"] / round_result["raw_samples_per_s"]
            results["rounds"].append(round_result)
            print(f"round {round_number}: {len(prompts)} samples, {tokens} tokens; raw {raw_samples:.1f} samples/s "
                  f"({raw_tokens:,.0f} tok/s), generate {round_result['generate_samples_per_s']:.1f} samples/s "
                  f"({round_result['generate_tokens_per_s']:,.0f} tok/s), ratio {round_result['ratio']:.3f}", flush=True)
    for key in ("raw_samples_per_s", "generate_samples_per_s", "raw_tokens_per_s", "generate_tokens_per_s", "ratio"):
        results[key] = summary([r[key] for r in results["rounds"]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"generate / raw senders: median {statistics.median(r['ratio'] for r in results['rounds']):.3f} "
          f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
