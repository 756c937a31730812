"""Host memory for the rows of each forward: one reserve pinned at startup, shared out to
forwards and taken back as their files are written."""

import logging
import threading
import weakref
from bisect import insort
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

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

    def __init__(self, reserve_bytes: int, pin_memory: bool):
        self.pin_memory = pin_memory
        size = aligned(reserve_bytes, self.REGION_ALIGNMENT)
        if pin_memory and size:
            # PyTorch's pinned allocator rounds every block up to a power of two (a 5.25 GiB
            # reserve held 8 GiB): use all of it.
            size = 1 << (size - 1).bit_length()
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
        if offset is None:
            buffer = self._overflow(nbytes)
        else:
            buffer = self.reserve[offset : offset + nbytes]
        views, start = {}, 0
        for (name, tensor), size in zip(tensors.items(), sizes):
            views[name] = buffer[start : start + size].view(tensor.dtype).view(tensor.shape)
            start += aligned(size, self.ALIGNMENT)
        rows = HostRows(**views, **fields_)
        if offset is not None:
            weakref.finalize(rows, self._give_back, offset, nbytes).atexit = False
        return rows

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

    def _overflow(self, nbytes: int) -> torch.Tensor:
        self.overflows += 1
        if self.overflows == 1:
            logger.warning(
                f"hidden states dump: a forward's rows ({nbytes / 2**20:.1f} MiB) found no room in "
                f"the {self.reserve.numel() / 2**20:.1f} MiB of host memory reserved at startup; "
                f"they get memory of their own, pinned now, on the scheduler thread. Raise "
                f"SGLANG_HS_DUMP_HOST_MEMORY_MB if this happens often (the dump's log line "
                f"counts host_overflows)."
            )
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)


def aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment
