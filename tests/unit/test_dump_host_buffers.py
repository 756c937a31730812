"""Host buffers reused across forwards: a forward's buffer comes back only once every file
that reads it is written, later forwards take the smallest free buffer that holds their
rows, and what they dump is still exactly their own rows."""

import torch

from sglang.srt.hidden_states_dump.host_buffers import HostBuffers
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import (assert_dumped, prompt, run_forward, start_dumper, wait_for_manifest,
                                      wait_for_writer)


def buffer_addresses(pool: HostBuffers):
    return sorted(buffer.data_ptr() for buffer in pool.free_buffers())


def test_a_forwards_buffer_comes_back_once_every_file_reading_it_is_written(dump_dir):
    dumper = start_dumper(dump_dir, [1, 2])
    pool = dumper.host_buffers

    # Forward 1: "whole" ends here, "chunked" goes on in forward 2 (a forward without
    # it would discard it).
    run_forward(dumper, [(DumpRequest("whole", 3), prompt(100, 3), 0),
                         (DumpRequest("chunked", 5), prompt(200, 3), 0)])
    wait_for_manifest(dump_dir, ["whole"])
    assert buffer_addresses(pool) == []  # "chunked" still reads forward 1's buffer

    run_forward(dumper, [(DumpRequest("chunked", 5), prompt(203, 2), 3)])
    wait_for_manifest(dump_dir, ["chunked"])
    held = buffer_addresses(pool)
    assert len(held) == 2

    # Later forwards, one written before the next and each smaller than the free
    # buffers, take them: no new buffer.
    for i in range(5):
        run_forward(dumper, [(DumpRequest(f"later-{i}", 4), prompt(300 + 10 * i, 4), 0)])
        wait_for_manifest(dump_dir, [f"later-{i}"])
    lines = wait_for_writer(dumper, dump_dir)
    assert buffer_addresses(pool) == held

    expected = {"whole": prompt(100, 3), "chunked": prompt(200, 5),
                **{f"later-{i}": prompt(300 + 10 * i, 4) for i in range(5)}}
    assert [line["rid"] for line in lines] == list(expected)
    for line in lines:
        assert_dumped(dump_dir, line, expected[line["rid"]], [1, 2])


def rows_of(pool: HostBuffers, mib: int):
    """Host rows of `mib` MiB in all (each tensor is 64-byte aligned in its buffer)."""
    return pool.rows({"token_ids": torch.empty(8, dtype=torch.int64),
                      "hidden_states": torch.empty((mib << 20) - 128, dtype=torch.uint8),
                      "last_hidden_state": torch.empty(64, dtype=torch.uint8)})


def free_mib(pool: HostBuffers):
    return [buffer.numel() >> 20 for buffer in pool.free_buffers()]


def test_a_forward_takes_the_smallest_free_buffer_that_holds_its_rows():
    pool = HostBuffers(pin_memory=False)
    held = [rows_of(pool, mib) for mib in (8, 64, 32)]
    del held
    assert free_mib(pool) == [8, 32, 64]
    free = {buffer.numel() >> 20: buffer.data_ptr() for buffer in pool.free_buffers()}

    rows = rows_of(pool, 17)  # not the 8 MiB buffer: the 32
    assert rows.token_ids.data_ptr() == free[32]
    assert rows.hidden_states.data_ptr() == free[32] + 64
    assert rows.last_hidden_state.data_ptr() == free[32] + (17 << 20) - 64
    assert free_mib(pool) == [8, 64]

    bigger = rows_of(pool, 65)  # none fits: a new buffer, at most an eighth larger
    assert bigger.token_ids.data_ptr() not in free.values()
    assert free_mib(pool) == [8, 64]
    del rows, bigger
    assert free_mib(pool) == [8, 32, 64, 72]
