"""Host memory for the rows of each forward: one reserve pinned at startup, shared out to
forwards and taken back as their files are written."""

import logging
import mmap
import os
import threading
import weakref
from bisect import insort
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.hidden_states_dump.copier import Landing
from sglang.srt.hidden_states_dump.format import FILE_TENSORS

logger = logging.getLogger(__name__)


@dataclass
class HostRows:
    """Rows of one forward on their way to the host; valid once `ready` says they have
    landed (no `ready`: valid now). fp8 rows carry their scales."""

    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    ready: Optional[Landing] = None
    hidden_states_scale: Optional[torch.Tensor] = None
    last_hidden_state_scale: Optional[torch.Tensor] = None
    # [T] bool, whether each row is finite (capture.with_finite_rows); not written to the file.
    finite_rows: Optional[torch.Tensor] = None

    def names(self) -> List[str]:
        """The file's tensors, in file order."""
        return [name for name in FILE_TENSORS if getattr(self, name) is not None]

    def wait(self, rows: Optional[int] = None) -> None:
        """Return once the first `rows` rows (None: all) are valid."""
        if self.ready is not None:
            self.ready.wait(rows)


@dataclass
class Chunk:
    """One request's rows inside the host rows of one forward."""

    rows: HostRows
    start: int  # row range of this request inside `rows`
    end: int

    def wait(self) -> None:
        """Return once this chunk's rows are valid (the forward's later rows may not be)."""
        self.rows.wait(self.end)

    def take(self, name: str) -> torch.Tensor:
        return getattr(self.rows, name)[self.start : self.end]

    def nonfinite_rows(self) -> int:
        """How many of this chunk's rows hold NaN or infinity (valid once they have landed)."""
        if self.rows.finite_rows is None:
            return 0
        return int(self.take("finite_rows").logical_not().sum())


class HostBuffers:
    """One block of host memory, pinned once when the server starts, from which each
    forward takes a region for its rows; the region comes back once the last file that
    reads it is written (its HostRows are gone). Pinning is slow (cudaHostAlloc maps and
    locks every page) and, done per forward on the scheduler thread, was the dump's
    largest cost there; PyTorch's caching host allocator reuses a freed pinned block only
    for a request of the same power-of-two size (scripts/bench/pinned.py; BENCHMARKS.md).

    A forward takes the smallest free region that holds its rows, and neighbouring free
    regions merge. Rows that find no room (more in flight than the reserve was sized for)
    get memory of their own, pinned then, and are counted in `overflows`."""

    ALIGNMENT = 64  # bytes, of each tensor inside a region
    REGION_ALIGNMENT = 4096  # bytes, of each region inside the reserve

    def __init__(self, reserve_bytes: int, pin_memory: bool, shared: bool = False):
        self.pin_memory = pin_memory
        # Memory a writer process maps too (SharedSegment), pinned by registering it.
        self.shared = shared
        size = aligned(reserve_bytes, self.REGION_ALIGNMENT)
        if pin_memory and size and not shared:
            # PyTorch's pinned allocator rounds every block up to a power of two (a 5.25 GiB
            # reserve held 8 GiB): use all of it.
            size = 1 << (size - 1).bit_length()
        self.segments: Dict[int, SharedSegment] = {}  # by id; the reserve is 0
        # Called with each new segment, on the thread that makes it (the writer process
        # maps it before a job reads it), and with the id of each segment no rows use any more.
        self.on_segment: Optional[Callable[["SharedSegment"], None]] = None
        self.on_forget: Optional[Callable[[int], None]] = None
        self._next_segment = 0
        if shared and size:
            self.reserve = self._new_segment(size).tensor
        else:
            # On the host whatever the default device (the model is being built under the GPU's).
            self.reserve = torch.empty(
                size,
                dtype=torch.uint8,
                device="cpu",
                pin_memory=pin_memory,
            )
        self.overflows = 0
        self._lock = threading.Lock()
        # Free regions as (offset, size), by offset.
        self._free: List[Tuple[int, int]] = [(0, self.reserve.numel())] if self.reserve.numel() else []

    def rows(self, tensors: Dict[str, torch.Tensor], **fields_) -> HostRows:
        """Empty host rows shaped like `tensors` (a forward's rows on the device), in one
        region that returns to the reserve with the rows."""
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors.values()]
        nbytes = sum(aligned(size, self.ALIGNMENT) for size in sizes)
        offset = self._take(nbytes)
        overflow = None
        if offset is None:
            buffer, overflow = self._overflow(nbytes)
        else:
            buffer = self.reserve[offset : offset + nbytes]
        views, start = {}, 0
        for (name, tensor), size in zip(tensors.items(), sizes):
            views[name] = buffer[start : start + size].view(tensor.dtype).view(tensor.shape)
            start += aligned(size, self.ALIGNMENT)
        rows = HostRows(**views, **fields_)
        if offset is not None:
            weakref.finalize(rows, self._give_back, offset, nbytes).atexit = False
        elif overflow is not None:
            weakref.finalize(rows, self._forget, overflow.id).atexit = False
        return rows

    def segment_of(self, tensor: torch.Tensor) -> Tuple[int, int]:
        """(segment id, byte offset) of where `tensor`'s data starts, in shared memory."""
        address = tensor.data_ptr()
        for segment in list(self.segments.values()):
            if segment.address <= address < segment.address + segment.size:
                return segment.id, address - segment.address
        raise ValueError("the rows are not in the dump's shared host memory")

    def free_regions(self) -> List[Tuple[int, int]]:
        """The free regions of the reserve, (offset, size) by offset."""
        with self._lock:
            return list(self._free)

    def _take(self, nbytes: int) -> Optional[int]:
        nbytes = aligned(nbytes, self.REGION_ALIGNMENT)
        with self._lock:
            fitting = [i for i, (_, size) in enumerate(self._free) if size >= nbytes]
            if not fitting:
                return None
            index = min(fitting, key=lambda i: self._free[i][1])
            offset, size = self._free[index]
            if size == nbytes:
                del self._free[index]
            else:
                self._free[index] = (offset + nbytes, size - nbytes)
            return offset

    def _give_back(self, offset: int, nbytes: int) -> None:
        nbytes = aligned(nbytes, self.REGION_ALIGNMENT)
        with self._lock:
            insort(self._free, (offset, nbytes))
            merged: List[Tuple[int, int]] = []
            for start, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((start, size))
            self._free = merged

    def _new_segment(self, size: int) -> "SharedSegment":
        segment = SharedSegment(self._next_segment, size, self.pin_memory)
        self._next_segment += 1
        self.segments[segment.id] = segment
        if self.on_segment is not None:
            self.on_segment(segment)
        return segment

    def _forget(self, segment_id: int) -> None:
        segment = self.segments.pop(segment_id)
        if self.on_forget is not None:
            self.on_forget(segment_id)
        segment.release()

    def _overflow(self, nbytes: int) -> Tuple[torch.Tensor, Optional["SharedSegment"]]:
        self.overflows += 1
        if self.overflows == 1:
            logger.warning(
                f"hidden states dump: a forward's rows ({nbytes / 2**20:.1f} MiB) found no room in "
                f"the {self.reserve.numel() / 2**20:.1f} MiB of host memory reserved at startup; "
                f"they get memory of their own, pinned now, on the scheduler thread. Raise "
                f"SGLANG_HS_DUMP_HOST_MEMORY_MB if this happens often (the dump's log line "
                f"counts host_overflows)."
            )
        if self.shared:
            segment = self._new_segment(aligned(nbytes, mmap.PAGESIZE))
            return segment.tensor, segment
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory), None


class SharedSegment:
    """Host memory in a memory file (memfd), which the writer process maps from its
    descriptor and the copier fills, pinned for the GPU's copies by registering it with
    CUDA (as SGLang's own host tables are)."""

    def __init__(self, segment_id: int, size: int, pin_memory: bool):
        self.id = segment_id
        self.size = size
        self.fd = os.memfd_create(f"hidden-states-dump-{segment_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()
        self.pinned = False
        if pin_memory:
            error = int(torch.cuda.cudart().cudaHostRegister(self.address, size, 0))
            if error:
                logger.warning(
                    f"hidden states dump: cudaHostRegister of {size} bytes of shared host "
                    f"memory failed (cudaError {error}); the rows are copied to it unpinned"
                )
            self.pinned = not error

    def release(self) -> None:
        """Unpin and close; the mapping goes with the last tensor viewing it."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        os.close(self.fd)
        self.tensor = None


def aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment
