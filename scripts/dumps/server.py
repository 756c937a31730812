"""A real SGLang server on the patched tree: launch it, wait for warmup, talk to it, stop it.

Used by the demo, the server tests and the benchmarks."""

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from scripts.paths import REPO_ROOT

READY_LINE = "The server is fired up and ready to roll!"
LISTENING_LINE = "Uvicorn running on"  # uvicorn starts once the scheduler has loaded the model
# How long a server gets to start: to be ready, or to refuse its settings and exit.
STARTUP_TIMEOUT_S = 600
# A wait given `stall_timeout` ends, besides on what it waits for, when the server's log has
# not grown for that long. Load on the cores slows a starting server but does not stop it, so
# a test can wait for what the server does (ready, or its exit) instead of a clock that load
# outruns: eight ranks starting on two cores beside other servers took from 3 to more than 10
# minutes. Its processes' CPU time tells nothing here: eight ranks hung in a gloo collective
# still spent a third of a core between them.
STALL_TIMEOUT_S = 300
PR_SET_PDEATHSIG = 1


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def device_flags() -> List[str]:
    if has_gpu():
        return ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
    # SGLang's CPU path: torch_native attention, no CUDA graphs.
    return ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]


def runtime_env(tree: Optional[Path] = None, **extra: str) -> Dict[str, str]:
    """The environment a server runs in: the patched tree first on the path, then the repo
    (for the oracle hooks); hidden-state dump variables are only those passed in."""
    tree = tree or Path(os.environ["SGLANG_CHECKOUT"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_HS_DUMP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(REPO_ROOT)])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if not has_gpu():
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.update(extra)
    return env


# SGLang 0.5.23 picks each server's torch.distributed port at random in 22000..29999 and binds
# it only later; a port the kernel hands out to connections lies at or above the ephemeral
# range's start. A server's HTTP port stays out of both, so that neither can take it from a
# server still loading its model.
SGLANG_NCCL_PORTS = range(22000, 30000)
SERVER_PORTS_FROM = 20000


def ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def server_port_candidates() -> List[int]:
    """The ports a server may listen on: from 20000 up to the ephemeral range, less SGLang's
    own torch.distributed range."""
    end = ephemeral_ports_start()
    return [port for port in range(SERVER_PORTS_FROM, end) if port not in SGLANG_NCCL_PORTS]


def free_port() -> int:
    """A free port for a server to listen on, from server_port_candidates()."""
    candidates = server_port_candidates()
    if not candidates:
        raise RuntimeError(f"no server ports below the ephemeral range (it starts at {ephemeral_ports_start()}); "
                           f"raise net.ipv4.ip_local_port_range's start above 30000")
    while True:
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def child_pids(pid: int) -> List[int]:
    """The processes `pid` started (any of its threads), from /proc."""
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


class ServerFailed(AssertionError):
    pass


# The memory sizes of the tests' servers: small, so that they fit a CI runner.
SMALL_SIZES = ["--max-total-tokens", "16384", "--mem-fraction-static", "0.5"]


def die_with_parent() -> None:
    # A server a command started must not outlive it: a SIGKILLed run followed by a rerun
    # would otherwise race the old server's in-flight requests into the manifest.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Server:
    def __init__(self, model: Path, log_path: Path, env: Dict[str, str], extra_args: Sequence[str] = (),
                 launcher: Sequence[str] = (), defaults: Optional[Sequence[str]] = None,
                 cwd: Optional[Path] = REPO_ROOT, tied_to_parent: bool = False, tokenizer: bool = False):
        """`launcher`: a command the server runs under (a profiler), which then leads its process group.
        `defaults`: the arguments before `extra_args` (default: the tests' sizes and device flags).
        `cwd`: where it runs (None: here). `tied_to_parent`: it dies with the process that started it.
        `tokenizer`: it loads its tokenizer (its chat endpoint works); else it is sent token ids only."""
        self.port = free_port()
        self.log_path = log_path
        if defaults is None:
            defaults = [*SMALL_SIZES, *device_flags()]
        self.args = [
            *launcher, sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            *([] if tokenizer else ["--skip-tokenizer-init"]),
            "--host", "127.0.0.1", "--port", str(self.port), *defaults, *extra_args,
        ]
        self.env = env
        self.cwd = cwd
        self.tied_to_parent = tied_to_parent
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exited(self) -> Optional[int]:
        """Its exit code once it has exited, else None."""
        return self.process.poll()

    @property
    def dump_dir(self) -> Optional[Path]:
        """Where this server dumps (SGLANG_HS_DUMP_DIR in its environment), if it does."""
        value = self.env.get("SGLANG_HS_DUMP_DIR")
        return Path(value) if value else None

    def start(self) -> "Server":
        if self.process is not None:
            # A second launch would take the first's port and log and leave it running unseen.
            raise RuntimeError(f"the server logging to {self.log_path} was started already")
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(self.args, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=self.cwd,
                                        preexec_fn=die_with_parent if self.tied_to_parent else None)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S, stall_timeout: Optional[float] = None) -> "Server":
        """Return once warmup is done; raise ServerFailed (with the log) if the server exits,
        times out, or (with `stall_timeout`) its log stays unchanged that long."""
        return self._wait_for_line(READY_LINE, "ready", timeout, stall_timeout)

    def wait_listening(self, timeout: float = STARTUP_TIMEOUT_S, stall_timeout: Optional[float] = None) -> "Server":
        """Return once the HTTP server listens: the model is loaded and its memory taken,
        warmup has yet to run. Raises ServerFailed as wait_ready does."""
        return self._wait_for_line(LISTENING_LINE, "listening", timeout, stall_timeout)

    def _wait_for_line(self, line: str, what: str, timeout: float, stall_timeout: Optional[float]) -> "Server":
        def reached():
            if line in self.log():
                return True
            if self.process.poll() is not None:
                raise ServerFailed(f"server exited with code {self.process.returncode} before it was {what}:\n"
                                   f"{self.log()[-6000:]}")
            return False

        self._wait(reached, what, timeout, stall_timeout)
        return self

    def wait_exit(self, timeout: float, stall_timeout: Optional[float] = None) -> int:
        """The exit code once the server has exited; ServerFailed if it runs past `timeout`
        or (with `stall_timeout`) its log stays unchanged that long."""
        self._wait(lambda: self.process.poll() is not None, "exited", timeout, stall_timeout)
        return self.process.returncode

    def _wait(self, reached: Callable[[], bool], what: str, timeout: float, stall_timeout: Optional[float]) -> None:
        start = time.monotonic()
        progress, progressed_at = self.log_path.stat().st_size, start
        while not reached():
            now = time.monotonic()
            if now - start > timeout:
                raise ServerFailed(f"server not {what} after {timeout:.0f}s:\n{self.log()[-6000:]}")
            if stall_timeout is not None:
                seen = self.log_path.stat().st_size
                if seen != progress:
                    progress, progressed_at = seen, now
                elif now - progressed_at > stall_timeout:
                    raise ServerFailed(f"server not {what} and its log unchanged for {stall_timeout:.0f}s:\n"
                                       f"{self.log()[-6000:]}")
            time.sleep(0.5)

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        payload = self.post_raw(path, body, timeout)
        return json.loads(payload) if payload else {}

    def post_raw(self, path: str, body: dict, timeout: float = 300) -> bytes:
        """POST `body` as JSON; the answer's bytes as they come (some endpoints answer in
        plain text)."""
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()

    def generate(self, input_ids, max_new_tokens: int = 2, **extra) -> dict:
        return self.post("/generate", {"input_ids": input_ids,
                                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
                                       **extra})

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.log_file.close()

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def processes(self) -> List[int]:
        """The server's process and all its descendants (scheduler, detokenizer)."""
        pids, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo += child_pids(pid)
        return pids

    def resident_memory_kb(self, field: str = "VmRSS") -> Dict[str, int]:
        """VmRSS (or another /proc/<pid>/status field in kB: RssAnon, RssFile, RssShmem) of
        each process of the server, by its name (`sglang::scheduler`, ...)."""
        memory = {}
        for pid in self.processes():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode() or str(pid)
            except OSError:
                continue
            rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith(f"{field}:")), 0)
            memory[name if name not in memory else f"{name}[{pid}]"] = rss
        return memory

    def __enter__(self):
        return self if self.process is not None else self.start()

    def __exit__(self, *exc):
        self.stop()
        # the scheduler may outlive the launcher in its own group members: make sure all are gone
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for_entries(follower, done: Callable[[List[dict]], bool], timeout: float = 60,
                     interval: float = 0.01) -> List[dict]:
    """Poll a ManifestFollower (each poll reads only what was appended) until
    `done(follower.entries)` holds or `timeout` seconds pass (the writer runs behind the
    forward); every entry seen so far, either way."""
    deadline = time.monotonic() + timeout
    follower.poll()
    while not done(follower.entries) and time.monotonic() < deadline:
        time.sleep(interval)
        follower.poll()
    return follower.entries


def wait_for_manifest(dump_dir: Path, count: int, timeout: float = 60) -> List[dict]:
    """The manifest once it has `count` entries."""
    from scripts.dump_format import ManifestFollower

    return wait_for_entries(ManifestFollower(str(dump_dir)), lambda entries: len(entries) >= count, timeout)
