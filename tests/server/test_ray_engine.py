"""SGLang's Ray engine (--use-ray) with dumping on, on a local Ray cluster of two nodes.

A scheduler actor runs in a Ray worker process, which takes its environment from the
`ray start` of its node, not from the server that asked for it: every node needs the dump's
variables and the patched tree on its path, and a node's SGLANG_HS_DUMP_WRITER_ID names the
manifest of the actors Ray places there. Checked here: two servers on one cluster, each
actor placed on its own node, each builds its dump writer for the shared directory with
its node's writer id and layers, none with the launcher's.

That is as far as SGLang 0.5.23's CPU path goes: the actor's event loop calls
torch.cuda.set_device (sglang/srt/ray/scheduler_actor.py, SchedulerActor.run_event_loop),
which fails without an NVIDIA driver, so the servers never answer a request here.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from scripts.dump_format import manifest_name
from scripts.dumps.server import Server, free_port, runtime_env
from tests.server.test_generate import DUMP_LAYERS

pytestmark = pytest.mark.skipif(
    not (Path(os.environ.get("SGLANG_CHECKOUT", "")) / "sglang" / "srt" / "ray").is_dir(),
    reason="this SGLang release has no Ray engine")

RAY_STARTED = re.compile(re.escape("Ray runtime started."))
HEAD_ADDRESS = re.compile(r"ray start --address='([^']+)'")
WRITER_STARTED = re.compile(r"hidden states dump on: dir=(\S+) manifest=(\S+) sink=\S+(?: \S+=\S+)* layers=(\[[0-9, ]*\])")


class RayNode:
    """One Ray node (`ray start --block`, in its own process group) with `env`. SGLang's
    scheduler actors ask for one GPU each: a node declares one, so Ray places one actor on
    each node."""

    def __init__(self, env: dict, log_path: Path, args: list):
        self.log_path = log_path
        self.args = [str(Path(sys.executable).with_name("ray")), "start", "--block", "--num-cpus", "1",
                     "--num-gpus", "1", "--disable-usage-stats", *args]
        self.env = env

    def log(self) -> str:
        return self.log_path.read_text()

    def __enter__(self):
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(self.args, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.wait_for(RAY_STARTED)
        return self

    def wait_for(self, pattern: re.Pattern, timeout: float = 300) -> re.Match:
        """The first match of `pattern` in the node's log, once it is there (`ray start`
        writes the head's address a moment after saying it started)."""
        deadline = time.monotonic() + timeout
        while not (found := pattern.search(self.log())):
            assert self.process.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.2)
        return found

    def __exit__(self, *exc):
        os.killpg(self.process.pid, signal.SIGKILL)  # the node's processes and its workers
        self.process.wait(30)
        self.log_file.close()


def node_env(out: Path, writer_id: str) -> dict:
    return runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS, SGLANG_HS_DUMP_WRITER_ID=writer_id)


def wait_for_writer(server: Server, timeout: float = 300):
    """(dump dir, manifest, layers) from the log line of the writer the server's actor built."""
    deadline = time.monotonic() + timeout
    while not (found := WRITER_STARTED.search(server.log())):
        assert server.exited() is None, server.log()[-6000:]
        assert time.monotonic() < deadline, server.log()[-6000:]
        time.sleep(0.2)
    return found.groups()


def test_each_node_dumps_under_its_own_writer_id(model_l3, tmp_path):
    out = tmp_path / "dump"
    # Ray's socket paths must stay short: its own temporary folder, not pytest's.
    ray_dir = tempfile.mkdtemp(prefix="ray-")
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, ray_dir, ignore_errors=True)
        head = stack.enter_context(RayNode(node_env(out, "node-a"), tmp_path / "ray-head.log",
                                           ["--head", "--port", str(free_port()), "--include-dashboard", "false",
                                            "--ray-client-server-port", str(free_port()), "--temp-dir", ray_dir]))
        address = head.wait_for(HEAD_ADDRESS).group(1)
        stack.enter_context(RayNode(node_env(out, "node-b"), tmp_path / "ray-worker.log", ["--address", address]))
        # The launcher's own writer id and layers (the default, [1, 2, 3]) reach no actor.
        launcher_env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_WRITER_ID="launcher",
                                   RAY_ADDRESS=address)
        servers = [stack.enter_context(Server(model_l3, tmp_path / f"server-{n}.log", launcher_env, ["--use-ray"]))
                   for n in (1, 2)]
        writers = [wait_for_writer(server) for server in servers]
        for server in servers:  # they cannot serve on the CPU (see above): nothing to stop gracefully
            server.kill()

    assert sorted(manifest for _, manifest, _ in writers) == [manifest_name(0, "node-a"), manifest_name(0, "node-b")]
    assert {(dump_dir, layers) for dump_dir, _, layers in writers} == {(str(out), "[2, 0, 3]")}
