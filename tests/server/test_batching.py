"""Batched serving: many concurrent requests of random lengths, prefilled together and
mixed with decode steps (--enable-mixed-chunk); every file equals the oracle row for row.
The rows cross to the host in slices of a few rows (the copier's slice size set small), so
the slices' seams fall inside requests and between them."""

import random
import time

from scripts.dump_format import load_dump
from tests.server import oracle_hooks
from scripts.bench.copier_hooks import slices_hook
from tests.server.dump_checks import (
    OUTPUT_TOKEN, assert_matches_oracle, generate_body, OracleServer, post_all, random_prompts)
from scripts.dumps.server import wait_for_manifest

NUM_REQUESTS = 48
NUM_LAYERS = 3
SLICE_BYTES = 4096  # a few rows of the test model's (rows of 3 layers and the final state)


def test_concurrent_requests_each_equal_the_oracle(model_l3, tmp_path):
    rng = random.Random(0)
    prompts = random_prompts([rng.randint(1, 500) for _ in range(NUM_REQUESTS)], seed=1)
    bodies = [generate_body(p, f"batch-{i}", max_new_tokens=rng.randint(1, 16)) for i, p in enumerate(prompts)]
    server = OracleServer(model_l3, tmp_path, NUM_LAYERS, ["--enable-mixed-chunk"],
                          extra_hooks=[slices_hook(SLICE_BYTES)])
    dump_dir, oracle_dir = server.dump_dir, server.oracle_dir
    with server:
        server.wait_ready()
        start = time.monotonic()
        responses = post_all(server, bodies, workers=64)
        print(f"{NUM_REQUESTS} requests in {time.monotonic() - start:.1f}s")
        manifest = wait_for_manifest(dump_dir, NUM_REQUESTS)
    assert f"in slices of at most {SLICE_BYTES} bytes" in server.log()
    assert all(r["output_ids"] == [OUTPUT_TOKEN] * b["sampling_params"]["max_new_tokens"]
               for r, b in zip(responses, bodies))

    by_rid = {entry["rid"]: entry for entry in manifest}
    assert sorted(by_rid) == sorted(b["rid"] for b in bodies) and len(manifest) == NUM_REQUESTS
    streams, forwards = oracle_hooks.request_rows(oracle_dir, {b["rid"]: p for b, p in zip(bodies, prompts)})
    for body, prompt in zip(bodies, prompts):
        entry = by_rid[body["rid"]]
        assert entry["num_tokens"] == len(prompt)
        assert_matches_oracle(load_dump(str(dump_dir / entry["file"])), prompt, streams[body["rid"]], body["rid"])

    # The workload did what it is for: prefill batches of many requests, prompts split
    # across forwards, and prefill rows next to decode rows in one forward.
    print("prompts per forward:", [len(f.prompts) for f in forwards])
    print("mixed forwards:", sum(1 for f in forwards if f.prompts and f.other_rows))
    assert max(len(f.prompts) for f in forwards) >= 8
    assert any(f.prompts and f.other_rows for f in forwards), "no mixed prefill+decode forward"
