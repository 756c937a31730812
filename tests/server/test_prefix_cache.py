"""The radix cache and the dump: a dumped prompt never starts from a cached prefix (its
file covers the whole prompt), while its KV cache is still there for requests that are
not dumped. Shared-prefix and repeated prompts, each file against the oracle."""

import random
import re

import pytest

from scripts.dump_format import load_dump, read_manifest
from tests.server import oracle_hooks
from tests.server.dump_checks import (
    FIRST_PROMPT_TOKEN, VOCAB_SIZE, assert_matches_oracle, generate_body, OracleServer, post_all)
from scripts.dumps.server import wait_for_manifest

NUM_LAYERS = 3


@pytest.fixture(scope="module")
def server(model_l3, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("prefix")
    server = OracleServer(model_l3, tmp_path, NUM_LAYERS)
    with server:
        server.wait_ready()
        yield server


def random_tokens(rng, length):
    return [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(length)]


def check_files(server, bodies, first_forward, before):
    """Every request has one file of its whole prompt, equal to the oracle; SGLang
    reports no cached token for it."""
    manifest = wait_for_manifest(server.dump_dir, before + len(bodies))[before:]
    assert sorted(e["rid"] for e in manifest) == sorted(b["rid"] for b in bodies)
    prompts = {b["rid"]: b["input_ids"] for b in bodies}
    streams, _ = oracle_hooks.request_rows(server.oracle_dir, prompts, first_forward)
    for entry in manifest:
        assert entry["num_tokens"] == len(prompts[entry["rid"]])
        record = load_dump(str(server.dump_dir / entry["file"]))
        assert_matches_oracle(record, prompts[entry["rid"]], streams[entry["rid"]], entry["rid"])


def prefill_log_cached_tokens(log):
    return [int(n) for n in re.findall(r"Prefill batch, .*?#cached-token: (\d+)", log)]


def test_shared_prefix(server):
    rng = random.Random(6)
    prefix = random_tokens(rng, 300)
    first_tokens = rng.sample(range(FIRST_PROMPT_TOKEN, VOCAB_SIZE), 32)
    bodies = [generate_body(prefix + [first] + random_tokens(rng, rng.randint(0, 150)), f"shared-{i}", 2)
              for i, first in enumerate(first_tokens)]
    first_forward = len(oracle_hooks.forward_files(server.oracle_dir))
    before = len(read_manifest(str(server.dump_dir)))
    log_before = server.log()
    # The first request puts the prefix in the radix cache, the rest could match it.
    responses = [server.post("/generate", bodies[0])] + post_all(server, bodies[1:])

    assert [r["meta_info"]["cached_tokens"] for r in responses] == [0] * len(bodies)
    assert set(prefill_log_cached_tokens(server.log()[len(log_before):])) == {0}
    check_files(server, bodies, first_forward, before)

    # The dumped requests' KV cache is shared: a request that is not dumped (an rid the
    # dump leaves to the server's own requests) starts from the cached prefix.
    control = generate_body(prefix + random_tokens(rng, 20), "HEALTH_CHECK_control", 2)
    assert server.post("/generate", control)["meta_info"]["cached_tokens"] >= len(prefix)
    assert "HEALTH_CHECK_control" not in [e["rid"] for e in read_manifest(str(server.dump_dir))]


def test_repeated_prompt(server):
    rng = random.Random(7)
    prompt = random_tokens(rng, 257)
    bodies = [generate_body(prompt, f"repeat-{i}", 2) for i in range(3)]
    first_forward = len(oracle_hooks.forward_files(server.oracle_dir))
    before = len(read_manifest(str(server.dump_dir)))
    responses = [server.post("/generate", body) for body in bodies]  # one after another: cached in between

    assert [r["meta_info"]["cached_tokens"] for r in responses] == [0, 0, 0]
    check_files(server, bodies, first_forward, before)
    # Each was prefilled whole in a forward of its own.
    _, forwards = oracle_hooks.request_rows(server.oracle_dir, {b["rid"]: prompt for b in bodies}, first_forward)
    assert sorted(f.prompt_rows for f in forwards if f.prompts) == [len(prompt)] * 3
