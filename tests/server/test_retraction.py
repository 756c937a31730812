"""Retraction: with a KV cache too small for the generations admitted, the scheduler takes
running requests back and prefills them again later (prompt plus the tokens generated so
far). That second prefill is not dumped: one file per request, equal to the oracle."""

import random

from scripts.dump_format import load_dump
from tests.server import oracle_hooks
from tests.server.dump_checks import assert_matches_oracle, generate_body, OracleServer, post_all, random_prompts
from scripts.dumps.server import wait_for_manifest

NUM_REQUESTS = 24
NUM_LAYERS = 3


def test_retracted_requests_are_dumped_once(model_l3, tmp_path):
    rng = random.Random(19)
    prompts = random_prompts([rng.randint(100, 200) for _ in range(NUM_REQUESTS)], seed=20)
    bodies = [generate_body(p, f"retract-{i}", max_new_tokens=300) for i, p in enumerate(prompts)]
    for body in bodies:
        # The logit bias alone keeps every request to max_new_tokens. From 0.5.23 on, the
        # scheduler reserves the whole of max_new_tokens for an ignore_eos request, so it
        # never admits more of them than the cache holds and never retracts one; a request
        # that may stop early is reserved a decaying fraction of it, which over-admits.
        body["sampling_params"]["ignore_eos"] = False
    server = OracleServer(model_l3, tmp_path, NUM_LAYERS, ["--max-total-tokens", "2048"])
    dump_dir, oracle_dir = server.dump_dir, server.oracle_dir
    with server:
        server.wait_ready()
        responses = post_all(server, bodies, workers=NUM_REQUESTS)
        manifest = wait_for_manifest(dump_dir, NUM_REQUESTS)
        log = server.log()

    # meta_info names the count total_retractions in 0.5.9, num_retractions in 0.5.14
    retractions = {b["rid"]: r["meta_info"].get("total_retractions", r["meta_info"].get("num_retractions"))
                   for b, r in zip(bodies, responses)}
    print(f"retractions per request: {retractions}")
    assert "KV cache pool is full. Retract requests." in log
    assert sum(1 for n in retractions.values() if n > 0) >= 2
    assert sorted(e["rid"] for e in manifest) == sorted(retractions)  # one line per request
    assert sorted(p.name for p in dump_dir.iterdir() if p.suffix == ".safetensors") == \
        sorted(e["file"] for e in manifest)
    streams, _ = oracle_hooks.request_rows(oracle_dir, {b["rid"]: p for b, p in zip(bodies, prompts)})
    for entry, prompt in zip(sorted(manifest, key=lambda e: int(e["rid"].split("-")[1])), prompts):
        assert_matches_oracle(load_dump(str(dump_dir / entry["file"])), prompt, streams[entry["rid"]], entry["rid"])
