"""The writer's back-pressure policy, with a disk that stalls (tests/server/fault_hooks.py),
one writer thread and a queue of one job: `drop` never makes the scheduler wait and counts
what it drops; `block` (the default) makes serving wait for the disk and loses nothing."""

import threading
import time

from scripts.dump_format import read_manifest
from tests.server.dump_checks import dump_stats, generate_body, random_prompts, wait_until
from tests.server.fault_hooks import stall_writer_spec
from scripts.dumps.server import Server, runtime_env, wait_for_manifest


def stalled_server(model, tmp_path, on_full):
    dump_dir, gate = tmp_path / "dump", tmp_path / "gate"
    gate.touch()
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_QUEUE_SIZE="1",
                      SGLANG_HS_DUMP_WRITER_THREADS="1", SGLANG_HS_DUMP_ON_FULL_QUEUE=on_full)
    return Server(model, tmp_path / "server.log", env, ["--forward-hooks", stall_writer_spec(gate)])


def hold_the_writer(server, tmp_path, prompt, rid) -> None:
    """Start the server and dump one request, which the stalled writer takes and holds."""
    server.wait_ready()
    server.post("/generate", generate_body(prompt, rid, 2))
    wait_until(lambda: (tmp_path / "gate.holding").exists(), 30, "the writer to hold the first job")


def test_drop_policy_never_waits_and_counts_every_drop(model_l3, tmp_path):
    prompts = random_prompts([50] * 8, seed=8)
    with stalled_server(model_l3, tmp_path, "drop") as server:
        hold_the_writer(server, tmp_path, prompts[0], "drop-0")
        start = time.monotonic()
        for i, prompt in enumerate(prompts[1:], start=1):  # one at a time: one job per forward
            server.post("/generate", generate_body(prompt, f"drop-{i}", 2), timeout=60)
        served_in = time.monotonic() - start
        log = server.log()
        assert read_manifest(str(server.dump_dir)) == []  # the disk is stalled
        assert dump_stats(log) == dict(files=0, tokens=0, bytes=0, errors=0, dropped=6, discarded=0,
                                      host_overflows=0, store_full=0, nonfinite=0)
        for i in range(2, 8):
            assert f"hidden states dump: queue full, dropped request 'drop-{i}'" in log

        (tmp_path / "gate").unlink()
        wait_for_manifest(server.dump_dir, 2)
        # A dropped request could only be listed before a request submitted after it (one
        # writer thread lists in submission order): once this one is listed, none can come.
        sentinel = random_prompts([50], seed=80)[0]
        server.post("/generate", generate_body(sentinel, "drop-sentinel", 2), timeout=60)
        manifest = wait_for_manifest(server.dump_dir, 3)
        assert [e["rid"] for e in manifest] == ["drop-0", "drop-1", "drop-sentinel"]
        assert dump_stats(server.log())["dropped"] == 6
        print(f"7 requests served in {served_in:.1f}s with the writer stalled")


def test_block_policy_makes_serving_wait_and_loses_nothing(model_l3, tmp_path):
    prompts = random_prompts([50] * 3, seed=9)
    with stalled_server(model_l3, tmp_path, "block") as server:
        hold_the_writer(server, tmp_path, prompts[0], "block-0")
        server.post("/generate", generate_body(prompts[1], "block-1", 2), timeout=60)  # queued
        third = threading.Thread(target=server.post, args=("/generate", generate_body(prompts[2], "block-2", 2)))
        third.start()
        # The scheduler has found the queue full with block-2 in hand: it cannot be answered
        # until the writer, held by the gate, takes a job.
        full = tmp_path / "gate.full"
        wait_until(lambda: full.exists() and full.read_text() == "block-2", 60,
                   "the scheduler to find the queue full")
        assert third.is_alive(), "block-2 was answered although the queue was full"
        assert read_manifest(str(server.dump_dir)) == []

        (tmp_path / "gate").unlink()
        third.join(60)
        assert not third.is_alive(), "block-2 not answered 60 s after the writer was let go"
        manifest = wait_for_manifest(server.dump_dir, 3)
        assert [e["rid"] for e in manifest] == ["block-0", "block-1", "block-2"]
        stats = dump_stats(server.log())
        assert stats["dropped"] == 0 and stats["errors"] == 0
