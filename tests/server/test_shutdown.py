"""A graceful shutdown writes what the dump has queued before the processes go: SIGTERM or
SIGINT to the server's launcher process (what an orchestrator or Ctrl-C sends), bounded by
SGLANG_HS_DUMP_DRAIN_TIMEOUT_S. The writer is held by a stalled disk
(tests/server/fault_hooks.py) until the shutdown has begun, so whatever lands afterwards
was written by the drain: without it the scheduler is killed with the requests queued."""

import os
import signal

import pytest

from scripts.dump_format import read_manifest
from scripts.dumps.server import Server, runtime_env
from tests.server.dump_checks import generate_body, random_prompts, wait_until
from tests.server.fault_hooks import stall_writer_spec

REQUESTS = 6
DRAINING = "hidden states dump: exiting; writing"


def stalled_server(model, tmp_path, drain_timeout_s: float) -> Server:
    gate = tmp_path / "gate"
    gate.touch()
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), SGLANG_HS_DUMP_WRITER_THREADS="1",
                      SGLANG_HS_DUMP_DRAIN_TIMEOUT_S=str(drain_timeout_s))
    return Server(model, tmp_path / "server.log", env, ["--forward-hooks", stall_writer_spec(gate)])


def queue_requests(server: Server, tmp_path) -> list:
    """Serve REQUESTS requests while the writer holds the first: all answered, none written."""
    server.wait_ready()
    rids = [f"queued-{i}" for i in range(REQUESTS)]
    for rid, prompt in zip(rids, random_prompts([40] * REQUESTS, seed=21)):
        server.post("/generate", generate_body(prompt, rid, 2), timeout=60)
    wait_until(lambda: (tmp_path / "gate.holding").exists(), 30, "the writer to hold the first job")
    assert read_manifest(str(server.dump_dir)) == []
    return rids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_graceful_shutdown_writes_every_queued_request(model_l3, tmp_path, signum):
    with stalled_server(model_l3, tmp_path, drain_timeout_s=60) as server:
        rids = queue_requests(server, tmp_path)
        os.kill(server.process.pid, signum)
        wait_until(lambda: DRAINING in server.log(), 60, "the dump to start draining")
        (tmp_path / "gate").unlink()  # the disk comes back only now
        server.wait_exit(timeout=90)
        log = server.log()
    assert f"{DRAINING} {REQUESTS} queued requests" in log
    assert f"hidden states dump: wrote the {REQUESTS} queued requests before exiting" in log
    assert [entry["rid"] for entry in read_manifest(str(server.dump_dir))] == rids


def test_the_drain_is_bounded_and_says_what_it_lost(model_l3, tmp_path):
    with stalled_server(model_l3, tmp_path, drain_timeout_s=3) as server:
        queue_requests(server, tmp_path)
        os.kill(server.process.pid, signal.SIGTERM)
        server.wait_exit(timeout=60)  # the disk never comes back
        log = server.log()
    assert f"hidden states dump: exiting with {REQUESTS} of {REQUESTS} queued requests not written " \
           f"(SGLANG_HS_DUMP_DRAIN_TIMEOUT_S=3)" in log
    assert read_manifest(str(server.dump_dir)) == []
