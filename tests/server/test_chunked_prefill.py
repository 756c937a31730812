"""Chunked prefill (--chunked-prefill-size 64): a prompt longer than a chunk is prefilled
over several forwards and stitched into one file that equals the oracle; a request that
leaves in the middle of its chunked prefill (aborted, client gone, rejected) leaves no
file, no manifest line and no held chunks."""

import http.client
import json
import math
import re
import threading
import time
import urllib.error

import pytest

from scripts.dump_format import load_dump, read_manifest
from tests.server import oracle_hooks
from tests.server.dump_checks import (
    assert_matches_oracle, dump_stats, generate_body, OracleServer, post_all, random_prompts, wait_until)
from scripts.dumps.server import wait_for_manifest

CHUNK = 64
NUM_LAYERS = 3
# Long enough to abort in the middle, short enough that the rest of its prefill (the
# scheduler finishes a chunked prefill before it acts on an abort) stays quick on the CPU.
LONG_PROMPT = 1024


@pytest.fixture(scope="module")
def server(model_l3, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("chunked")
    # The tokenizer manager checks for a gone client at this interval in seconds (default 4).
    server = OracleServer(model_l3, tmp_path, NUM_LAYERS, ["--chunked-prefill-size", str(CHUNK)],
                           SGLANG_REQUEST_STATE_WAIT_TIMEOUT="1")
    with server:
        server.wait_ready()
        yield server


def dumped_files(dump_dir):
    return sorted(p.name for p in dump_dir.iterdir() if p.name != "manifest.jsonl")


def test_long_prompts_are_stitched_across_chunks(server):
    lengths = [1, 63, 64, 65, 127, 128, 129, 200, 333, 500, 777, 1000]
    prompts = random_prompts(lengths, seed=2)
    bodies = [generate_body(p, f"chunked-{len(p)}", max_new_tokens=3) for p in prompts]
    first_forward = len(oracle_hooks.forward_files(server.oracle_dir))
    before = len(read_manifest(str(server.dump_dir)))
    post_all(server, bodies)
    manifest = wait_for_manifest(server.dump_dir, before + len(bodies))[before:]

    by_rid = {entry["rid"]: entry for entry in manifest}
    assert sorted(by_rid) == sorted(b["rid"] for b in bodies)
    streams, forwards = oracle_hooks.request_rows(
        server.oracle_dir, {b["rid"]: p for b, p in zip(bodies, prompts)}, first_forward)
    for body, prompt in zip(bodies, prompts):
        record = load_dump(str(server.dump_dir / by_rid[body["rid"]]["file"]))
        assert_matches_oracle(record, prompt, streams[body["rid"]], body["rid"])
    # Every forward prefilled at most one chunk, so a 1000-token prompt took at least 16 of
    # them (more when a forward's chunk was shared with another prompt's rows).
    assert max(f.prompt_rows for f in forwards) <= CHUNK
    assert sum(1 for f in forwards if "chunked-1000" in f.prompts) >= math.ceil(1000 / CHUNK)


def discard_lines(log: str, rid: str):
    return re.findall(rf"hidden states dump: request {re.escape(repr(rid))} left after (\d+) of (\d+) prompt tokens; "
                      r"nothing written", log)


def start_long_request(server, rid, prompt):
    """Send the request from a thread once; return the thread and a box for its outcome."""
    outcome = {}

    def send():
        try:
            outcome["response"] = server.post("/generate", generate_body(prompt, rid, max_new_tokens=4))
        except urllib.error.HTTPError as e:
            outcome["error"] = e.code

    thread = threading.Thread(target=send)
    thread.start()
    return thread, outcome


def wait_for_chunks(server, first_forward, count):
    wait_until(lambda: len(oracle_hooks.forward_files(server.oracle_dir)) >= first_forward + count, 60,
               f"{count} chunks of the long prompt")


def assert_left_without_trace(server, rid, log_before):
    """No file, no manifest line, its chunks discarded (logged, counted), and the server
    still dumps the next request."""
    follow_up = random_prompts([100], seed=hash(rid) % 1000)[0]
    before = len(read_manifest(str(server.dump_dir)))
    server.post("/generate", generate_body(follow_up, f"after-{rid}", max_new_tokens=2))
    manifest = wait_for_manifest(server.dump_dir, before + 1)
    assert [e["rid"] for e in manifest[before:]] == [f"after-{rid}"]
    assert rid not in [e["rid"] for e in manifest]
    assert dumped_files(server.dump_dir) == sorted(e["file"] for e in manifest)
    log = server.log()[len(log_before):]
    (left_after, prompt_len), = discard_lines(log, rid)
    assert 0 < int(left_after) < int(prompt_len) and int(left_after) % CHUNK == 0
    return int(left_after), dump_stats(server.log())


def test_abort_in_the_middle_of_a_chunked_prefill(server):
    rid = "abort-me"
    prompt = random_prompts([LONG_PROMPT], seed=3)[0]
    log_before = server.log()
    first_forward = len(oracle_hooks.forward_files(server.oracle_dir))
    start = time.monotonic()
    thread, outcome = start_long_request(server, rid, prompt)
    wait_for_chunks(server, first_forward, 3)
    server.post("/abort_request", {"rid": rid})
    thread.join(120)
    assert not thread.is_alive(), "the aborted request not answered within 120 s"
    print(f"aborted request returned after {time.monotonic() - start:.1f}s: {outcome}")
    left_after, stats = assert_left_without_trace(server, rid, log_before)
    print(f"left after {left_after} tokens; {stats}")
    assert stats["discarded"] >= 1


def test_client_gone_in_the_middle_of_a_chunked_prefill(server):
    rid = "client-gone"
    prompt = random_prompts([3 * LONG_PROMPT], seed=4)[0]  # still prefilling when the server notices
    log_before = server.log()
    first_forward = len(oracle_hooks.forward_files(server.oracle_dir))
    connection = http.client.HTTPConnection("127.0.0.1", server.port)
    connection.request("POST", "/generate", json.dumps(generate_body(prompt, rid, max_new_tokens=4)),
                       {"Content-Type": "application/json"})
    wait_for_chunks(server, first_forward, 3)
    connection.sock.shutdown(2)
    connection.close()
    # The dump lets go of a request's chunks at the first prefill batch that does not
    # continue it: 0.5.9 runs one by itself after the abort, 0.5.14 only with the next
    # request, which assert_left_without_trace sends. That request must reach the scheduler
    # after the abort: the tokenizer manager sends the abort, then logs this line, and sends
    # every request to the scheduler down the same socket, in order.
    wait_until(lambda: f"Abort request obj.rid={rid!r}" in server.log()[len(log_before):], 60,
               "the server to notice the client is gone")
    left_after, stats = assert_left_without_trace(server, rid, log_before)
    print(f"left after {left_after} tokens; {stats}")


def test_request_the_scheduler_rejects_is_not_dumped(server):
    """The scheduler turns an invalid request into a one-token prefill that finishes as
    an abort; that token is not the client's prompt and is not dumped."""
    prompt = random_prompts([10], seed=5)[0]
    body = dict(generate_body(prompt, "rejected", max_new_tokens=2), return_logprob=True, logprob_start_len=50)
    before = read_manifest(str(server.dump_dir))
    with pytest.raises(urllib.error.HTTPError) as error:
        server.post("/generate", body)
    assert error.value.code == 400
    server.post("/generate", generate_body(prompt, "accepted", max_new_tokens=2))
    manifest = wait_for_manifest(server.dump_dir, len(before) + 1)
    assert [e["rid"] for e in manifest[len(before):]] == ["accepted"]
    assert dumped_files(server.dump_dir) == sorted(e["file"] for e in manifest)
