"""Dumped answers' decode rows, staged where the forward made them: a decode step that
carries a dumped answer copies its rows into buffers the dump keeps on the forward's device,
in order on the forward's stream, and the staged rows go on to the host together, through
the dump's usual gather and copy, once the buffers are full or a request among them
finishes. A decode step then costs the scheduler thread a few device copies instead of a
gather, an event and a copy job of its own; the rows, and the order in which they reach
their requests, are the same.
"""

from typing import List, Optional, Set, Tuple

import torch

from sglang.srt.hidden_states_dump.requests import DumpRequest

# Rows staged before they go to the host together (K + 2 values of the model's width a row
# on its device: 14.7 MB for 256 rows of a 61-layer DeepSeek-V3 dumping three layers in bf16).
STAGED_ROWS = 256


class StagedAnswerRows:
    def __init__(self, capacity: int = STAGED_ROWS):
        self.capacity = capacity
        self.input_ids: Optional[torch.Tensor] = None  # [C], as the batch holds them
        self.hidden_states: Optional[torch.Tensor] = None  # [C, H]: the final states
        self.aux_hidden_states = None  # as the model hands them: packed [C, K * H], or K of [C, H]
        self.stream = None  # the forward's stream, on which they are staged (CUDA)
        self._rows: List[Tuple[DumpRequest, int]] = []  # each staged row's request and position
        self._rids: Set[str] = set()

    def __len__(self) -> int:
        return len(self._rows)

    def holds(self, rid: str) -> bool:
        return rid in self._rids

    def stage(self, input_ids: torch.Tensor, hidden_states: torch.Tensor, aux_hidden_states, spans) -> bool:
        """Copy the rows that `spans` (request, prefix_len, start, end) cover after those
        staged; False, and nothing staged, when they do not fit."""
        count = sum(end - start for _, _, start, end in spans)
        if len(self._rows) + count > self.capacity:
            return False
        if self.hidden_states is None:
            self._allocate(input_ids, hidden_states, aux_hidden_states)
        if hidden_states.is_cuda:
            self.stream = torch.cuda.current_stream()
        slot = len(self._rows)
        for start, end in contiguous_runs(spans):
            staged = slice(slot, slot + end - start)
            self.input_ids[staged].copy_(input_ids[start:end])
            self.hidden_states[staged].copy_(hidden_states[start:end])
            if isinstance(aux_hidden_states, torch.Tensor):
                self.aux_hidden_states[staged].copy_(aux_hidden_states[start:end])
            else:
                for buffer, states in zip(self.aux_hidden_states, aux_hidden_states):
                    buffer[staged].copy_(states[start:end])
            slot += end - start
        for request, prefix_len, start, end in spans:
            self._rows.extend((request, prefix_len + offset) for offset in range(end - start))
            self._rids.add(request.rid)
        return True

    def take(self):
        """The staged rows as a forward's would be, (input_ids, hidden_states,
        aux_hidden_states, spans: one a row), and staging starts again empty. The tensors are
        views of the buffers: gather them on `stream` before anything more is staged."""
        num_rows = len(self._rows)
        aux = self.aux_hidden_states
        aux = aux[:num_rows] if isinstance(aux, torch.Tensor) else [states[:num_rows] for states in aux]
        spans = [(request, position, row, row + 1) for row, (request, position) in enumerate(self._rows)]
        self._rows, self._rids = [], set()
        return self.input_ids[:num_rows], self.hidden_states[:num_rows], aux, spans

    def _allocate(self, input_ids, hidden_states, aux_hidden_states) -> None:
        def like(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.new_empty((self.capacity,) + tuple(tensor.shape[1:]))

        self.input_ids = like(input_ids)
        self.hidden_states = like(hidden_states)
        if isinstance(aux_hidden_states, torch.Tensor):
            self.aux_hidden_states = like(aux_hidden_states)
        else:
            self.aux_hidden_states = [like(states) for states in aux_hidden_states]


def contiguous_runs(spans) -> List[Tuple[int, int]]:
    """The spans' row ranges, adjacent ones merged: one copy a run."""
    runs: List[List[int]] = []
    for _, _, start, end in spans:
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return [(start, end) for start, end in runs]
