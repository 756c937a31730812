"""The Mooncake sink's side of a benchmark run: one store on this machine (a mooncake_master
and a mooncake_client lending it memory, over TCP on loopback, scripts/online/master.py) that
every Mooncake sink contender's server puts into, and per contender a consumer
(scripts/bench/store_consumer.py) that takes each published sample out again.

A round of such a contender ends, as a file dump's does, when its manifest names every
sample; the run then waits until the consumer has acknowledged them all (untimed, so the next
contender's round finds the store empty and no consumer busy), and reports how long that took.
"""

import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from scripts.dump_format import ManifestFollower
from scripts.dumps.server import die_with_parent, runtime_env
from scripts.online.master import MooncakeMaster
from scripts.online.stream import CLOSED_MARKER, acknowledged_count
from scripts.paths import REPO_ROOT

DRAIN_POLL_S = 0.005
DRAIN_TIMEOUT_S = 300
CONSUMER_EXIT_TIMEOUT_S = 60
LOG_TAIL_CHARS = 3000


class LocalStore:
    """The store and the consumers of the contenders `consumers` names ({contender: (control
    directory, consumer mode)}); nothing is started when it names none."""

    def __init__(self, work: Path, segment_size: int, consumers: Dict[str, Tuple[Path, str]]):
        self.work = work
        self.segment_size = segment_size
        self.consumers = consumers
        self.master: Optional[MooncakeMaster] = None
        self.processes: Dict[str, subprocess.Popen] = {}
        self.logs: Dict[str, Path] = {}
        self.followers = {name: ManifestFollower(str(control_dir)) for name, (control_dir, _) in consumers.items()}

    def start(self) -> "LocalStore":
        if not self.consumers:
            return self
        self.master = MooncakeMaster(self.work / "mooncake-master.log", segment_size=self.segment_size).start()
        for index, (name, (control_dir, mode)) in enumerate(self.consumers.items()):
            self.logs[name] = self.work / f"store-consumer-{index}-{mode}.log"
            with open(self.logs[name], "w") as log:
                # The servers' environment (the bundle's packages, this repository), which
                # reaches the store as theirs does.
                self.processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "scripts.bench.store_consumer", str(control_dir), "--mode", mode],
                    env=runtime_env(**self.master.env()), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        return self

    def env(self, name: str) -> Dict[str, str]:
        """The MOONCAKE_* settings of contender `name`'s server (none for other contenders)."""
        return self.master.env() if name in self.consumers else {}

    def round_drained(self, name: str) -> Tuple[int, float]:
        """After a round of contender `name` has landed: the bytes its samples hold in the
        store, and the seconds until its consumer had acknowledged every one of them."""
        published = sum(entry["bytes"] for entry in self.followers[name].poll())
        target = len(self.followers[name].entries)
        control_dir = self.consumers[name][0]
        started = time.perf_counter()
        while acknowledged_count(control_dir) < target:
            if self.processes[name].poll() is not None:
                raise RuntimeError(f"the store consumer of {name} exited with code {self.processes[name].returncode}:\n"
                                   f"{self.log_tail(name)}")
            if self.master.failure() is not None:
                raise RuntimeError(self.master.failure())
            if time.perf_counter() - started > DRAIN_TIMEOUT_S:
                raise RuntimeError(f"{name}: {acknowledged_count(control_dir)} of {target} samples acknowledged "
                                   f"after {DRAIN_TIMEOUT_S} s:\n{self.log_tail(name)}")
            time.sleep(DRAIN_POLL_S)
        return published, time.perf_counter() - started

    def stop(self) -> Dict[str, str]:
        """Once the servers have stopped: close each control directory (its consumer ends after
        the last sample), then stop the store. Each consumer's last line ({contender: line})."""
        for control_dir, _ in self.consumers.values():
            (control_dir / CLOSED_MARKER).touch()
        for process in self.processes.values():
            try:
                process.wait(CONSUMER_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.master is not None:
            self.master.stop()
        return {name: (self.log_tail(name).strip().splitlines() or [""])[-1] for name in self.processes}

    def log_tail(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")[-LOG_TAIL_CHARS:]
