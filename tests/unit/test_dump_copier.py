"""The rows' copy to the host: on its own thread, in slices of at most slice_bytes, in the
order submitted; a failed copy fails its Landing (and so the writes that wait on it) and
the copier goes on with the next forward's rows."""

import threading

import pytest
import torch

from sglang.srt.hidden_states_dump.copier import Landing, RowsCopier, row_slices


def test_row_slices_cover_the_rows_within_the_bound():
    rows = torch.zeros(10, 3, 4, dtype=torch.bfloat16)  # 24 bytes a row
    assert list(row_slices(rows, 50)) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert list(row_slices(rows, 10)) == [(i, i + 1) for i in range(10)]  # one row at least
    assert list(row_slices(rows, 1 << 20)) == [(0, 10)]


def test_copies_every_forward_in_slices_on_its_own_thread():
    copier = RowsCopier(torch.device("cpu"), slice_bytes=64)
    threads, sliced = set(), []
    original = torch.Tensor.copy_

    def recording_copy(self, source, *args, **kwargs):
        threads.add(threading.current_thread().name)
        sliced.append(source.shape[0])
        return original(self, source, *args, **kwargs)

    forwards = []
    torch.Tensor.copy_ = recording_copy
    try:
        for forward in range(3):
            states = torch.randn(7, 2, 8) + forward  # 64 bytes a row in float32
            token_ids = torch.arange(7, dtype=torch.int64) + 100 * forward
            host = (torch.empty_like(token_ids), torch.empty_like(states))
            landing = Landing()
            copier.submit([(token_ids, host[0]), (states, host[1])], None, landing)
            forwards.append((token_ids, states, host, landing))
        for token_ids, states, host, landing in forwards:
            landing.wait()
            assert torch.equal(host[0], token_ids) and torch.equal(host[1], states)
    finally:
        torch.Tensor.copy_ = original
    assert threads == {"hidden-states-dump-copier"}
    # Token ids (8 bytes a row) in one slice of 7 rows, the states a row at a time.
    assert sliced == [7, 1, 1, 1, 1, 1, 1, 1] * 3


def test_a_failed_copy_fails_its_landing_and_not_the_next():
    copier = RowsCopier(torch.device("cpu"))
    broken, whole = Landing(), Landing()
    copier.submit([(torch.ones(4, 3), torch.empty(4, 5))], None, broken)  # shapes disagree
    source = torch.randn(4, 3)
    target = torch.empty(4, 3)
    copier.submit([(source, target)], None, whole)
    with pytest.raises(RuntimeError, match="copy to the host failed"):
        broken.wait()
    whole.wait()
    assert torch.equal(target, source)
