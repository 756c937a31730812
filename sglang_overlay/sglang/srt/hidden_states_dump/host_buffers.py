"""Host memory for the rows of each forward, reused across forwards."""

import threading
import weakref
from bisect import insort
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from sglang.srt.hidden_states_dump.format import FILE_TENSORS


@dataclass
class HostRows:
    """Rows of one forward on their way to the host; valid once `ready` has completed.
    fp8 rows carry their scales."""

    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    ready: Optional[torch.cuda.Event] = None
    hidden_states_scale: Optional[torch.Tensor] = None
    last_hidden_state_scale: Optional[torch.Tensor] = None

    def names(self) -> List[str]:
        """The file's tensors, in file order."""
        return [name for name in FILE_TENSORS if getattr(self, name) is not None]

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class Chunk:
    """One request's rows inside the host rows of one forward."""

    rows: HostRows
    start: int  # row range of this request inside `rows`
    end: int

    def take(self, name: str) -> torch.Tensor:
        return getattr(self.rows, name)[self.start : self.end]


class HostBuffers:
    """Host buffers for the rows of each forward, reused across forwards: a forward's
    buffer comes back once the last file that reads it is written (its HostRows are
    gone), and a later forward takes the smallest free buffer that holds its rows.
    PyTorch's caching host allocator reuses a freed pinned block only for a request of
    the same power-of-two size, so forwards of mixed sizes kept pinning new blocks long
    after warm-up (scripts/bench/pinned.py; BENCHMARKS.md). The pool never holds more
    buffers than were in flight at once."""

    ALIGNMENT = 64  # bytes, of each tensor inside a buffer

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._free: List[torch.Tensor] = []  # uint8 buffers, by ascending size

    def rows(self, tensors: Dict[str, torch.Tensor], **fields_) -> HostRows:
        """Empty host rows shaped like `tensors` (a forward's rows on the device), in one
        buffer of the pool that returns to it with the rows."""
        sizes = [tensor.numel() * tensor.element_size() for tensor in tensors.values()]
        buffer = self._take(sum(aligned(size, self.ALIGNMENT) for size in sizes))
        views, offset = {}, 0
        for (name, tensor), size in zip(tensors.items(), sizes):
            views[name] = buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            offset += aligned(size, self.ALIGNMENT)
        rows = HostRows(**views, **fields_)
        weakref.finalize(rows, self._give_back, buffer).atexit = False
        return rows

    def free_buffers(self) -> List[torch.Tensor]:
        with self._lock:
            return list(self._free)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for index, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    return self._free.pop(index)
        # At most an eighth more than asked for (2 MiB steps below 32 MiB).
        size = aligned(nbytes, max(1 << 21, 1 << max(nbytes.bit_length() - 4, 0)))
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            insort(self._free, buffer, key=torch.Tensor.numel)


def aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment
