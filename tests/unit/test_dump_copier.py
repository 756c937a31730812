"""The rows' copy to the host: on its own thread, in slices of at most slice_bytes taken
row-wise across every tensor of a forward, in the order submitted; a writer waits for its
own rows only; a failed copy fails its Landing (and so the writes that wait on it) and the
copier goes on with the next forward's rows. On the CPU the copier's copies start no OpenMP
team beside the forwards'."""

import os
import threading

import pytest
import torch

from sglang.srt.hidden_states_dump.copier import Landing, RowsCopier, row_slices
from tests.unit.dump_standins import bits


def test_row_slices_cover_the_rows_of_every_tensor_within_the_bound():
    token_ids = torch.zeros(10, dtype=torch.int64)
    states = torch.zeros(10, 3, 4, dtype=torch.bfloat16)  # with its token id, 32 bytes a row
    pairs = [(token_ids, None), (states, None)]
    assert list(row_slices(pairs, 64)) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert list(row_slices(pairs, 10)) == [(i, i + 1) for i in range(10)]  # one row at least
    assert list(row_slices(pairs, 1 << 20)) == [(0, 10)]


def test_copies_every_forward_in_slices_on_its_own_thread():
    copier = RowsCopier(torch.device("cpu"), slice_bytes=150)
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
            states = torch.randn(7, 2, 8) + forward  # 64 bytes a row in float32, 72 with the id
            token_ids = torch.arange(7, dtype=torch.int64) + 100 * forward
            host = (torch.empty_like(token_ids), torch.empty_like(states))
            landing = Landing()
            copier.submit({"token_ids": token_ids, "hidden_states": states},
                          {"token_ids": host[0], "hidden_states": host[1]}, None, landing)
            forwards.append((token_ids, states, host, landing))
        for token_ids, states, host, landing in forwards:
            landing.wait()
            assert torch.equal(host[0], token_ids) and torch.equal(host[1], states)
    finally:
        torch.Tensor.copy_ = original
    assert threads == {"hidden-states-dump-copier"}
    # Two rows of both tensors a slice, the last slice the one row left.
    assert sliced == [2, 2, 2, 2, 2, 2, 1, 1] * 3


def test_a_failed_copy_fails_its_landing_and_not_the_next():
    copier = RowsCopier(torch.device("cpu"))
    broken, whole = Landing(), Landing()
    copier.submit({"hidden_states": torch.ones(4, 3)}, {"hidden_states": torch.empty(4, 5)}, None, broken)  # shapes disagree
    source = torch.randn(4, 3)
    target = torch.empty(4, 3)
    copier.submit({"hidden_states": source}, {"hidden_states": target}, None, whole)
    with pytest.raises(RuntimeError, match="copy to the host failed"):
        broken.wait()
    whole.wait()
    assert torch.equal(target, source)


def test_a_writer_waits_for_its_own_rows_only():
    copier = RowsCopier(torch.device("cpu"), slice_bytes=64)  # a row of 64 bytes a slice
    second_slice = threading.Event()
    original = torch.Tensor.copy_

    def held_copy(self, source, *args, **kwargs):
        if source.data_ptr() == states[1].data_ptr():
            second_slice.wait()
        return original(self, source, *args, **kwargs)

    states = torch.randn(3, 16)
    host = torch.zeros(3, 16)
    landing = Landing()
    torch.Tensor.copy_ = held_copy
    try:
        copier.submit({"hidden_states": states}, {"hidden_states": host}, None, landing)
        landing.wait(1)  # the first row's writer goes on while the copier holds the second
        assert torch.equal(host[0], states[0])
        assert not host[1:].any()
        second_slice.set()
        landing.wait()
    finally:
        second_slice.set()
        torch.Tensor.copy_ = original
    assert torch.equal(host, states)


def test_fp8_rows_are_quantized_on_the_copiers_thread_into_the_layout_made_before():
    from sglang.srt.hidden_states_dump import format as dump_format

    rows = {"token_ids": torch.arange(5, dtype=torch.int64),
            "hidden_states": torch.randn(5, 2, 8, dtype=torch.bfloat16),
            "last_hidden_state": torch.randn(5, 8, dtype=torch.bfloat16)}
    layout = dump_format.quantized_file_rows_like(rows)
    targets = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in layout.items()}
    threads = []
    original = dump_format.quantize_rows

    def recording_quantize(tensor):
        threads.append(threading.current_thread().name)
        return original(tensor)

    dump_format.quantize_rows = recording_quantize
    try:
        landing = Landing()
        RowsCopier(torch.device("cpu"), slice_bytes=64).submit(rows, targets, None, landing, quantize=True)
        landing.wait()
    finally:
        dump_format.quantize_rows = original
    assert threads == ["hidden-states-dump-copier"] * 2
    expected = dump_format.quantize_file_rows(rows)
    assert set(targets) == set(expected)
    for name, target in targets.items():
        assert target.dtype == expected[name].dtype and target.shape == expected[name].shape
        assert torch.equal(bits(target), bits(expected[name]))


def test_waiters_go_in_turn_as_their_rows_land_and_all_go_when_the_copy_fails():
    landing = Landing()
    done, failed = {}, {}

    def waiter(rows):
        try:
            landing.wait(rows)
            done[rows] = True
        except RuntimeError as e:
            failed[rows] = e

    threads = {rows: threading.Thread(target=waiter, args=(rows,)) for rows in (2, 5, 9, None)}
    for thread in threads.values():
        thread.start()
    landing.landed(5)
    threads[2].join(5)
    threads[5].join(5)
    assert done == {2: True, 5: True}
    assert threads[9].is_alive() and threads[None].is_alive()  # their rows have not landed
    landing.failed(OSError("copy engine"))
    for thread in threads.values():
        thread.join(5)
    assert set(failed) == {9, None} and "copy engine" in str(failed[9])
    with pytest.raises(RuntimeError, match="copy to the host failed"):
        landing.wait(1)  # a later wait on a failed landing fails at once


def live_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="with one thread no parallel op starts an OpenMP team")
def test_a_copy_on_the_cpu_starts_no_openmp_team_beside_the_forwards():
    """A parallel op on a second thread starts an OpenMP team of its own, and with more OpenMP
    threads than cores every parallel region of the forwards waits for its threads to wake
    (copier.keep_ops_on_this_thread). A thread that copies the rows plainly, the control,
    starts a team; the copier's copies of the same rows run on its thread alone."""
    rows = torch.randn(1 << 20)  # far above ATen's grain: its copy runs in parallel
    rows.clone()  # this thread's own team, if it has none yet
    copied, release = threading.Event(), threading.Event()

    def plain_copy():
        torch.set_num_threads(2)  # a copier of an earlier test set the count new threads take to 1
        torch.empty_like(rows).copy_(rows)
        copied.set()
        release.wait()

    before = live_threads()
    control = threading.Thread(target=plain_copy)
    control.start()
    try:  # the control's team stays up until the end, so no thread leaves while the copier is counted
        assert copied.wait(60)
        if live_threads() <= before + 1:
            pytest.skip("this build's copy of the rows started no team of its thread's own: nothing to keep")
        copier = RowsCopier(torch.device("cpu"))
        before = live_threads()
        landing, target = Landing(), torch.empty_like(rows)
        copier.submit({"hidden_states": rows}, {"hidden_states": target}, None, landing)
        landing.wait()
        assert torch.equal(target, rows)
        assert live_threads() == before, "the copier's copy started threads of its own"
    finally:
        release.set()
        control.join()
