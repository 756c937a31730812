"""The rows' copy to the host, on a thread of its own, in slices.

A GPU runs its device-to-host copies one after another. SGLang copies each forward's sampled
tokens to the host on the forward's stream, and the next forward waits for that copy; queued
behind a forward's whole rows (470 MB, 8.5 ms at 55 GB/s on an H200), it held every forward
of a dumping server back by that long (BENCHMARKS.md, "The forward stream waits for the
rows"). So the copier issues the rows in slices of SLICE_BYTES and the next slice only once
the one before has landed: a copy of SGLang's waits for one slice at most.

Writers wait on each forward's Landing; a copy that fails fails the writes that need it.
"""

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

# 0.3 ms at an H200's 55 GB/s: a copy of SGLang's waits no longer than that for the dump's.
SLICE_BYTES = 16 << 20
# On a CUDA device: one slice in flight, issued by the copier's thread (True), or every
# slice of a forward queued at once on the copy stream by the thread that submits (False).
PACED = True


class Landing:
    """Whether one forward's rows have reached the host."""

    def __init__(self):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._event: Optional[torch.cuda.Event] = None

    def landed(self, event: Optional[torch.cuda.Event] = None) -> None:
        """The rows have landed, or will have once `event` completes."""
        self._event = event
        self._done.set()

    def failed(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        """Return once the rows are on the host; raise if their copy failed."""
        self._done.wait()
        if self._event is not None:
            self._event.synchronize()
        if self._error is not None:
            raise RuntimeError(f"the rows' copy to the host failed: {self._error!r}") from self._error


@dataclass
class CopyJob:
    pairs: List[Tuple[torch.Tensor, torch.Tensor]]  # (device rows, host rows), alike in shape
    gathered: Optional[torch.cuda.Event]  # recorded once the device rows are complete
    landing: Landing


def row_slices(rows: torch.Tensor, slice_bytes: int) -> Iterator[Tuple[int, int]]:
    """(start, end) row ranges of `rows` of at most `slice_bytes` each (one row at least)."""
    row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 1
    step = max(1, slice_bytes // max(1, row_bytes))
    for start in range(0, rows.shape[0], step):
        yield start, min(start + step, rows.shape[0])


class RowsCopier:
    """One thread that copies each forward's device rows into their host rows, in the order
    submitted, and marks each forward's Landing. It holds the device rows until they are
    copied. On a CUDA device the copies run on a stream of their own, after the event the
    rows were gathered under; elsewhere they are plain copies."""

    def __init__(self, device: torch.device, slice_bytes: Optional[int] = None):
        self.device = device
        self.slice_bytes = slice_bytes or SLICE_BYTES
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.paced = PACED or self.stream is None
        self._jobs: "queue.SimpleQueue[CopyJob]" = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="hidden-states-dump-copier", daemon=True
        )
        self._thread.start()
        logger.info(
            f"hidden states dump: rows copied to the host on {device} in slices of at "
            f"most {self.slice_bytes} bytes"
            + ("" if self.paced else ", all queued at once")
        )

    def submit(self, pairs, gathered: Optional[torch.cuda.Event], landing: Landing) -> None:
        if self.paced:
            self._jobs.put(CopyJob(list(pairs), gathered, landing))
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(gathered)
            for device_rows, host_rows in pairs:
                for start, end in row_slices(device_rows, self.slice_bytes):
                    host_rows[start:end].copy_(device_rows[start:end], non_blocking=True)
                # Freed by the caller once queued: not reused before the copies are done.
                device_rows.record_stream(self.stream)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        landing.landed(copied)

    def _run(self) -> None:
        if self.stream is not None:
            # The current device is per thread; this one copies on the rank's own.
            torch.cuda.set_device(self.device)
        sliced = torch.cuda.Event() if self.stream is not None else None
        while True:
            job = self._jobs.get()
            try:
                self._copy(job, sliced)
            except Exception as e:
                job.landing.failed(e)
            else:
                job.landing.landed()
            del job  # the device rows go back to their stream's pool, copied

    def _copy(self, job: CopyJob, sliced: Optional[torch.cuda.Event]) -> None:
        if self.stream is None:
            for device_rows, host_rows in job.pairs:
                for start, end in row_slices(device_rows, self.slice_bytes):
                    host_rows[start:end].copy_(device_rows[start:end])
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(job.gathered)
            for device_rows, host_rows in job.pairs:
                for start, end in row_slices(device_rows, self.slice_bytes):
                    host_rows[start:end].copy_(device_rows[start:end], non_blocking=True)
                    sliced.record(self.stream)
                    sliced.synchronize()
