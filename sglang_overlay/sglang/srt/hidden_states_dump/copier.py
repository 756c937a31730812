"""The rows' copy to the host, on a thread of its own, in slices.

A GPU runs its device-to-host copies one after another. SGLang copies each forward's sampled
tokens to the host on the forward's stream, and the next forward waits for that copy; queued
behind a forward's whole rows (470 MB, 8.5 ms at 55 GB/s on an H200), it held every forward
of a dumping server back by that long (BENCHMARKS.md, "The forward stream waits for the
rows"). So the copier issues the rows in slices of SLICE_BYTES and the next slice only once
the one before has landed: a copy of SGLang's waits for one slice at most.

A slice is a range of rows of every tensor of the forward, in row order, so the first
requests' rows land first: a writer waits on the forward's Landing for its own rows only and
writes them while the rest are still crossing. A copy that fails fails the writes that wait.

In fp8 the copier quantizes the rows before it copies them (on the copy stream on a GPU, in
one pass: fp8_rows): the kernels are launched on its thread, not the scheduler's.
"""

import logging
import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from sglang.srt.hidden_states_dump import fp8_rows
from sglang.srt.hidden_states_dump.format import quantize_file_rows

logger = logging.getLogger(__name__)

# 0.3 ms at an H200's 55 GB/s: a copy of SGLang's waits no longer than that for the dump's.
SLICE_BYTES = 16 << 20


class Landing:
    """How many of one forward's rows (from the first) have reached the host.

    Each waiter is woken once: when its rows have landed, or the copy failed. A slice wakes
    no writer whose rows are still crossing, since every wake-up takes the interpreter lock
    from the scheduler thread for a moment (BENCHMARKS.md, "The tail and the interpreter
    lock")."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rows = 0
        self._all = False
        self._error: Optional[BaseException] = None
        # (the rows awaited, None: all; a lock held until then), one per waiting thread
        self._waiters: List[Tuple[Optional[int], threading.Lock]] = []

    def landed(self, rows: Optional[int] = None) -> None:
        """The first `rows` rows have landed (None: all of them)."""
        with self._lock:
            if rows is None:
                self._all = True
            else:
                self._rows = rows
            waiting, due = [], []
            for awaited, gate in self._waiters:
                (due if self._have(awaited) else waiting).append((awaited, gate))
            self._waiters = waiting
        for _, gate in due:
            gate.release()

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            due, self._waiters = self._waiters, []
        for _, gate in due:
            gate.release()

    def wait(self, rows: Optional[int] = None) -> None:
        """Return once the first `rows` rows (None: all) are on the host; raise if their
        copy failed."""
        with self._lock:
            gate = None
            if not self._have(rows):
                gate = threading.Lock()
                gate.acquire()
                self._waiters.append((rows, gate))
        if gate is not None:
            gate.acquire()  # released by landed or failed
        if self._error is not None:
            raise RuntimeError(
                f"the rows' copy to the host failed: {self._error!r}"
            ) from self._error

    def _have(self, rows: Optional[int]) -> bool:
        """Whether a wait for `rows` is over (under the lock)."""
        return (
            self._error is not None
            or self._all
            or (rows is not None and self._rows >= rows)
        )


@dataclass
class CopyJob:
    rows: Dict[str, torch.Tensor]  # the forward's rows on the device, by file tensor name
    targets: Dict[str, torch.Tensor]  # the host rows they are copied into, by the same names
    gathered: Optional[torch.cuda.Event]  # recorded once the device rows are complete
    landing: Landing
    quantize: bool  # quantize the rows to fp8 first (the targets have fp8's layout)


def row_slices(pairs, slice_bytes: int) -> Iterator[Tuple[int, int]]:
    """(start, end) row ranges of the rows in `pairs` (tensors of one forward, alike in
    rows), taken across all of them, of at most `slice_bytes` each (one row at least)."""
    rows = [device_rows for device_rows, _ in pairs]
    num_rows = rows[0].shape[0]
    row_bytes = sum(t[0].numel() * t.element_size() for t in rows) if num_rows else 1
    step = max(1, slice_bytes // max(1, row_bytes))
    for start in range(0, num_rows, step):
        yield start, min(start + step, num_rows)


def keep_ops_on_this_thread() -> None:
    """Run the calling thread's CPU tensor ops on it alone. A parallel op from a second thread
    starts an OpenMP team of its own; with more OpenMP threads than cores GNU OpenMP stops
    spinning between parallel regions, so every parallel region of the forwards then waits for
    its threads to wake. On 2 cores a server that had copied one dumped request's rows served
    at 0.48 of its rate from then on (BENCHMARKS.md, "Live traffic"). torch.set_num_threads
    sets this thread's OpenMP and MKL counts, and the count a thread takes at its first
    parallel op; called at the first copy, after warmup, the forwards' thread has long taken
    its own."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class RowsCopier:
    """One thread that copies each forward's device rows into their host rows (quantizing
    fp8 rows first), in the order submitted, and marks each forward's Landing. It holds the
    device rows until they are copied. On a CUDA device the copies run on a stream of their
    own, after the event the rows were gathered under; elsewhere they are plain copies."""

    def __init__(self, device: torch.device, slice_bytes: Optional[int] = None):
        self.device = device
        self.slice_bytes = slice_bytes or SLICE_BYTES
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._jobs: "queue.SimpleQueue[CopyJob]" = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="hidden-states-dump-copier", daemon=True
        )
        self._thread.start()
        logger.info(
            f"hidden states dump: rows copied to the host on {device} in slices of at "
            f"most {self.slice_bytes} bytes"
        )

    def submit(
        self,
        rows: Dict[str, torch.Tensor],
        targets: Dict[str, torch.Tensor],
        gathered: Optional[torch.cuda.Event],
        landing: Landing,
        quantize: bool = False,
    ) -> None:
        """Copy `rows` (quantized to fp8 first when `quantize`) into `targets`, every
        target filled from the row tensor of its name, once `gathered` has completed."""
        self._jobs.put(CopyJob(rows, targets, gathered, landing, quantize))

    def _run(self) -> None:
        if self.stream is not None:
            # The current device is per thread; this one copies on the rank's own.
            torch.cuda.set_device(self.device)
        sliced = torch.cuda.Event() if self.stream is not None else None
        while True:
            job = self._jobs.get()
            if self.stream is None:
                keep_ops_on_this_thread()
            try:
                self._copy(job, sliced)
            except Exception as e:
                job.landing.failed(e)
            else:
                job.landing.landed()
            del job  # the device rows go back to their stream's pool, copied

    def _copy(self, job: CopyJob, sliced: Optional[torch.cuda.Event]) -> None:
        on_device = self.stream is not None
        with torch.cuda.stream(self.stream) if on_device else nullcontext():
            if on_device:
                self.stream.wait_event(job.gathered)
            rows = quantize_file_rows(job.rows, fp8_rows.quantize_rows) if job.quantize else job.rows
            pairs = [(rows[name], target) for name, target in job.targets.items()]
            for start, end in row_slices(pairs, self.slice_bytes):
                for device_rows, host_rows in pairs:
                    host_rows[start:end].copy_(device_rows[start:end], non_blocking=on_device)
                if on_device:
                    sliced.record(self.stream)
                    sliced.synchronize()
                job.landing.landed(end)
