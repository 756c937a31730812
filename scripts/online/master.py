"""A real Mooncake store on this host, on loopback: a mooncake_master, Mooncake's HTTP metadata
server and, given a segment size, a mooncake_client that lends the store its memory (the
servers dumping into it lend none). Used by the Mooncake sink's tests and the online demo; by
hand:

    python -m scripts.online.master [--port RPC_PORT] [--segment-size BYTES] ...

runs one in the foreground and prints the `export MOONCAKE_...` lines a shell needs to reach it.

Mooncake's binaries link libibverbs.so.1 even for TCP: where the host has none, `make runtime`
unpacks it into .venv/libibverbs, which must be on LD_LIBRARY_PATH (make's RUNTIME_ENV puts it
there); the processes started here inherit this one's environment."""

import argparse
import ctypes
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from scripts.paths import CACHE_DIR

LOOPBACK = "127.0.0.1"
PACKAGE = "mooncake-transfer-engine-non-cuda"
PR_SET_PDEATHSIG = 1
READY_POLL_S = 0.05
LOG_TAIL_CHARS = 4000
CLI_SEGMENT_SIZE = 4 << 30  # mooncake_client's own default; its pages are taken only as objects fill them


class MasterFailed(RuntimeError):
    """A Mooncake process is missing, exited, or never became ready."""


METADATA_MODULE = "mooncake.http_metadata_server"


def mooncake_executable(name: str) -> str:
    """A console script of Mooncake's wheel: next to this Python first (a venv's bin need not
    be on PATH), else on PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return str(beside_python)
    on_path = shutil.which(name)
    if on_path is None:
        raise MasterFailed(f"no {name} next to {sys.executable} or on PATH: install {PACKAGE} "
                           f"(requirements/runtime.txt; make runtime)")
    return on_path


def free_ports(count: int) -> List[int]:
    """`count` loopback ports nothing listens on, all held at once so that no two are the same."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for held in sockets:
            held.bind((LOOPBACK, 0))
        return [held.getsockname()[1] for held in sockets]
    finally:
        for held in sockets:
            held.close()


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    # A store left behind by a killed test run would hold its ports and memory. The signal
    # comes when the thread that started it ends: start a store from a thread that lives as long.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def log_tail(path: Path) -> str:
    text = path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if path.exists() else ""
    if "libibverbs.so.1" in text:
        text += ("\n(Mooncake's binaries need libibverbs.so.1 even for TCP: `make runtime` unpacks it into "
                 ".venv/libibverbs; put that folder on LD_LIBRARY_PATH)")
    return text


class MooncakeMaster:
    """A mooncake_master on free loopback ports (or those given), with Mooncake's HTTP
    metadata server; with `segment_size` also a mooncake_client lending the store that many bytes.
    None for an eviction setting or the lease TTL keeps the master's default (evict 5% of the
    objects once 90% of the memory is used; a lease of 10 s, during which a read object cannot be
    removed without force). A context manager: entering starts it and waits until it serves."""

    def __init__(self, log_path: Optional[Path] = None, segment_size: int = 0, rpc_port: Optional[int] = None,
                 metadata_port: Optional[int] = None, eviction_ratio: Optional[float] = None,
                 eviction_high_watermark_ratio: Optional[float] = None, lease_ttl_ms: Optional[int] = None):
        """`log_path`: the master's log (the memory client's goes next to it, `<stem>.client.log`);
        None: a temporary folder, removed on stop."""
        self.owned_log_dir = Path(tempfile.mkdtemp(prefix="mooncake-master-")) if log_path is None else None
        self.log_path = Path(log_path) if log_path is not None else self.owned_log_dir / "master.log"
        self.client_log_path = self.log_path.with_name(f"{self.log_path.stem}.client.log")
        self.metadata_log_path = self.log_path.with_name(f"{self.log_path.stem}.metadata.log")
        self.segment_size = segment_size
        chosen = iter(free_ports(4))
        self.rpc_port = rpc_port or next(chosen)
        self.metadata_port = metadata_port or next(chosen)
        self.metrics_port = next(chosen)
        self.client_port = next(chosen)
        self.master_args = [
            f"--rpc_address={LOOPBACK}", f"--rpc_port={self.rpc_port}",
            f"--metrics_host={LOOPBACK}", f"--metrics_port={self.metrics_port}",
        ]
        # Not the master's embedded metadata server: it listens on every address whatever
        # --http_metadata_server_host says. Mooncake's standalone one binds where it is told.
        self.metadata_args = [f"--host={LOOPBACK}", f"--port={self.metadata_port}", "--log-level=WARNING"]
        for flag, value in (("eviction_ratio", eviction_ratio),
                            ("eviction_high_watermark_ratio", eviction_high_watermark_ratio),
                            ("default_kv_lease_ttl", lease_ttl_ms)):
            if value is not None:
                self.master_args.append(f"--{flag}={value}")
        self.master: Optional[subprocess.Popen] = None
        self.metadata_server: Optional[subprocess.Popen] = None
        self.client: Optional[subprocess.Popen] = None

    def env(self) -> Dict[str, str]:
        """The MOONCAKE_* variables that point a store client at this store."""
        return {
            "MOONCAKE_MASTER_SERVER_ADDR": f"{LOOPBACK}:{self.rpc_port}",
            "MOONCAKE_METADATA_SERVER": f"http://{LOOPBACK}:{self.metadata_port}/metadata",
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_LOCAL_HOSTNAME": LOOPBACK,
        }

    def start(self, timeout: float = 60) -> "MooncakeMaster":
        """Start the master, the metadata server (and the memory client); return once they
        serve, or stop them and raise MasterFailed with the log's tail."""
        try:
            self.master = self._spawn("mooncake_master", self.master_args, self.log_path)
            # Its module, not its console script: a script's first line names the Python it was
            # installed with, which a carried bundle (the GPU machine's) does not have.
            self.metadata_server = self._spawn("mooncake_http_metadata_server", self.metadata_args,
                                               self.metadata_log_path, [sys.executable, "-m", METADATA_MODULE])
            self._wait_until(lambda: all(accepts_connections(port) for port in (self.rpc_port, self.metadata_port)),
                             f"listening on ports {self.rpc_port} (RPC) and {self.metadata_port} (metadata)", timeout)
            if self.segment_size:
                settings = self.env()
                self.client = self._spawn("mooncake_client", [
                    f"--host={LOOPBACK}", f"--port={self.client_port}",
                    f"--master_server_address={settings['MOONCAKE_MASTER_SERVER_ADDR']}",
                    f"--metadata_server={settings['MOONCAKE_METADATA_SERVER']}",
                    f"--protocol={settings['MOONCAKE_PROTOCOL']}", f"--global_segment_size={self.segment_size}",
                ], self.client_log_path)
                self._wait_until(lambda: self.capacity() >= self.segment_size,
                                 f"holding {self.segment_size} bytes of memory", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def capacity(self) -> int:
        """The bytes of memory mounted in the store, from the master's metrics."""
        return self.metric("master_total_capacity_bytes")

    def key_count(self) -> int:
        """How many objects the store holds, by the master's own count."""
        return self.metric("master_key_count")

    def metric(self, name: str) -> int:
        """One of the master's metrics; 0 before its metrics server answers."""
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=5) as response:
                metrics = response.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return 0  # the metrics server starts a moment after the RPC one
        return next((int(float(line.split()[1])) for line in metrics.splitlines()
                     if line.startswith(f"{name} ")), 0)

    def processes(self) -> List[subprocess.Popen]:
        """The store's processes that run."""
        return [process for process in (self.metadata_server, self.master, self.client)
                if process is not None and process.poll() is None]

    def failure(self) -> Optional[str]:
        """Which process has exited, with its code and log tail; None while all run."""
        for name, process, log in (("mooncake_http_metadata_server", self.metadata_server, self.metadata_log_path),
                                   ("mooncake_master", self.master, self.log_path),
                                   ("mooncake_client", self.client, self.client_log_path)):
            if process is not None and process.poll() is not None:
                return f"{name} exited with code {process.returncode} (log {log}):\n{log_tail(log)}"
        return None

    def stop(self) -> None:
        """Stop the memory client, then the master, then the metadata server (the client
        unregisters there); remove the logs if they were temporary."""
        for process in (self.client, self.master, self.metadata_server):
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)
        if self.owned_log_dir is not None:
            shutil.rmtree(self.owned_log_dir, ignore_errors=True)

    def _spawn(self, name: str, args: Sequence[str], log_path: Path,
               command: Optional[List[str]] = None) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            # Its own session: a terminal's Ctrl-C reaches the caller, which stops it in order.
            return subprocess.Popen([*(command or [mooncake_executable(name)]), *args], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)

    def _wait_until(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            failure = self.failure()
            if failure is not None:
                raise MasterFailed(f"the Mooncake store stopped before {what}: {failure}")
            if time.monotonic() > deadline:
                raise MasterFailed(f"the Mooncake store not {what} after {timeout:.0f}s (log {self.log_path}):\n"
                                   f"{log_tail(self.log_path)}")
            time.sleep(READY_POLL_S)
        failure = self.failure()  # a port taken by another process looks ready while ours exits
        if failure is not None:
            raise MasterFailed(f"the Mooncake store stopped: {failure}")

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=None, help="the master's RPC port (default: a free one)")
    parser.add_argument("--metadata-port", type=int, default=None,
                        help="the HTTP metadata server's port (default: a free one)")
    parser.add_argument("--segment-size", type=int, default=CLI_SEGMENT_SIZE,
                        help="bytes of memory a mooncake_client lends the store; 0: none, the store's "
                             f"clients lend their own (default: {CLI_SEGMENT_SIZE})")
    parser.add_argument("--eviction-ratio", type=float, default=None,
                        help="the share of objects evicted once memory is short (master default 0.05)")
    parser.add_argument("--eviction-high-watermark-ratio", type=float, default=None,
                        help="the share of memory in use that starts eviction (master default 0.9)")
    parser.add_argument("--lease-ttl-ms", type=int, default=None,
                        help="how long a read object is leased (master default 10000)")
    parser.add_argument("--log", type=Path, default=CACHE_DIR / "mooncake-master.log")
    args = parser.parse_args(argv)

    # SIGTERM ends the `with` below as Ctrl-C does, so the store's processes stop with this one.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    master = MooncakeMaster(args.log, segment_size=args.segment_size, rpc_port=args.port,
                            metadata_port=args.metadata_port, eviction_ratio=args.eviction_ratio,
                            eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
                            lease_ttl_ms=args.lease_ttl_ms)
    try:
        with master:
            for name, value in master.env().items():
                print(f"export {name}={shlex.quote(value)}")
            print(f"# log: {master.log_path}; Ctrl-C stops the store", flush=True)
            while master.failure() is None:
                try:
                    master.master.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            print(master.failure(), file=sys.stderr)
            return 1
    except MasterFailed as error:
        print(error, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
