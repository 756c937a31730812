"""One benchmark run: its preset, work folder, clock and deadline, and the results file it
saves as suites progress. Every suite gets the run instead of reading module state."""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, Optional

from scripts.dumps.server import Server, runtime_env

# Every contender prefills whole prompts. A dumped prompt never matches a cached prefix; the
# others would match the first tokens random prompts share, and on DeepSeek a batch with any
# prefix takes another attention path (on the CPU the absorbed-MLA one, several times slower).
NO_PREFIX_CACHE = ("--disable-radix-cache",)
# An idle SGLang scheduler polls in a busy loop; with several servers on one machine that
# loop takes the cores the working server needs (on 2 cores a round took 6.5x as long
# with a second, idle server running). Sleeping when idle keeps the contenders apart.
SERVER_ARGS = NO_PREFIX_CACHE + ("--sleep-on-idle",)


@dataclass
class BenchRun:
    preset: dict
    model: Path
    work: Path
    out: Path
    results: dict
    deadline: float = float("inf")  # time.monotonic() after which no new round starts
    started: float = field(default_factory=time.monotonic)
    suite: Optional[str] = None  # the suite running now, whose partial results checkpoint() saves
    contenders: Optional[str] = None  # a regex: the prefill suite keeps the contenders it matches

    def progress(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {message}", flush=True)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def rounds(self) -> Iterator[int]:
        """The indices of the preset's repeated rounds; past the deadline no new round starts
        (but the first, so every comparison keeps one)."""
        for index in range(self.preset["repeats"]):
            if index and self.out_of_time():
                return
            yield index

    def checkpoint(self, partial: dict) -> None:
        """Save a suite's results so far, so a run cut short keeps them."""
        self.results[self.suite] = dict(partial, partial=True)
        self.save()

    def save(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1))

    def start_server(self, name: str, env: Dict[str, str], extra=(), tree: Optional[Path] = None,
                     launcher=()) -> Server:
        args = [*self.preset["server_args"], *extra]
        return Server(self.model, self.work / f"{name}.log", runtime_env(tree=tree, **env), args, launcher).start()


def total_rss_kib(server: Server) -> int:
    """Resident memory of all of a server's processes, in KiB."""
    return sum(server.resident_memory_kb().values())


def rss_parts_kib(server: Server) -> Dict[str, int]:
    """Resident memory of all of a server's processes by kind, in KiB: anonymous (the
    processes' own), file-backed (mapped files, e.g. weights read through mmap, which the
    page cache may hold for other processes too) and shared memory."""
    return {field: sum(server.resident_memory_kb(field).values()) for field in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}
