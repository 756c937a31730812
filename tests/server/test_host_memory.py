"""Host memory over a long run: the scheduler process (which holds the dump's chunks, its
queue and its writer thread) does not grow with the number of requests dumped."""

import random
import time

from tests.server.dump_checks import generate_body, post_all, random_prompts
from scripts.dumps.inspect_dump import summarise
from scripts.dumps.server import Server, runtime_env, wait_for_manifest

NUM_REQUESTS = 1000
WARM_UP = 200  # requests before the baseline: allocator pools, caches and the queue fill up
ROUNDS = 8
GROWTH_BOUND = 0.15


def test_scheduler_memory_stays_flat_over_1000_requests(model_l3, tmp_path):
    dump_dir = tmp_path / "dump"
    rng = random.Random(17)
    lengths = [rng.randint(1, 256) for _ in range(NUM_REQUESTS)]
    bodies = [generate_body(p, f"rss-{i}", rng.randint(1, 4)) for i, p in enumerate(random_prompts(lengths, seed=18))]
    samples = []
    with Server(model_l3, tmp_path / "server.log", runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir))) as server:
        server.wait_ready()
        start = time.monotonic()
        post_all(server, bodies[:WARM_UP], workers=16)
        wait_for_manifest(dump_dir, WARM_UP)
        samples.append((WARM_UP, server.resident_memory_kb()))
        per_round = (NUM_REQUESTS - WARM_UP) // ROUNDS
        for done in range(WARM_UP + per_round, NUM_REQUESTS + 1, per_round):
            post_all(server, bodies[done - per_round:done], workers=16)
            wait_for_manifest(dump_dir, done)
            samples.append((done, server.resident_memory_kb()))
        elapsed = time.monotonic() - start

    summary = summarise(dump_dir)
    assert summary.requests == NUM_REQUESTS and summary.problems == []
    print(f"\n{NUM_REQUESTS} requests, {summary.tokens} prompt tokens, {summary.bytes / 1e6:.0f} MB dumped "
          f"in {elapsed:.0f}s")
    print("requests  scheduler VmRSS MB  all processes MB")
    for done, memory in samples:
        print(f"{done:8d}  {memory['sglang::scheduler'] / 1024:18.1f}  {sum(memory.values()) / 1024:16.1f}")
    baseline = samples[0][1]["sglang::scheduler"]
    peak_after = max(memory["sglang::scheduler"] for _, memory in samples[1:])
    growth = peak_after / baseline - 1
    print(f"scheduler growth after warm-up: {growth:+.1%}")
    assert growth < GROWTH_BOUND
