"""The dump's counters and timings, summed across threads and logged for operators."""

import logging
import threading
import time
from dataclasses import fields
from typing import Dict, Optional, Tuple

from sglang.srt.hidden_states_dump.format import DumpCounters, DumpTimings

logger = logging.getLogger(__name__)

# Logged after every error, drop, discard and sample with non-finite rows, after the first
# file (the dump works), at exit, then every LOG_EVERY_FILES files or LOG_INTERVAL_S seconds.
LOG_INTERVAL_S = 60.0
LOG_EVERY_FILES = 1000
ALWAYS_LOGGED = ("errors", "dropped", "discarded", "nonfinite")


class DumpStats:
    """Counters (DumpCounters) and timings (DumpTimings, summed in seconds, logged in ms)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in fields(DumpCounters)}
        self._seconds = {f.name: 0.0 for f in fields(DumpTimings)}
        self._last_log = time.monotonic()

    def add(self, seconds: Optional[Dict[str, float]] = None, **counts) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value
            for name, value in (seconds or {}).items():
                self._seconds[name] += value
            files = self._counts["files"]
            due = any(name in counts for name in ALWAYS_LOGGED) or "files" in counts and (
                files == 1
                or files % LOG_EVERY_FILES == 0
                or time.monotonic() - self._last_log > LOG_INTERVAL_S
            )
        if due:
            self.log()

    def log(self) -> None:
        with self._lock:
            self._last_log = time.monotonic()
            counters, timings = self._snapshot()
        logger.info(f"{DumpCounters.LOG_PREFIX}{counters.line()}")
        logger.info(f"{DumpTimings.LOG_PREFIX}{timings.line()}")

    def counters(self) -> DumpCounters:
        with self._lock:
            return self._snapshot()[0]

    def timings(self) -> DumpTimings:
        with self._lock:
            return self._snapshot()[1]

    def _snapshot(self) -> Tuple[DumpCounters, DumpTimings]:
        timings = {name: int(value * 1000) for name, value in self._seconds.items()}
        return DumpCounters(**self._counts), DumpTimings(**timings)
