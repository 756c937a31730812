"""Host memory reserved at startup: a forward's rows take a region of the reserve that comes
back only once every file reading it is written, later forwards take the smallest free region
that holds their rows, free neighbours merge, rows that find no room get memory of their own
and are counted, and what every forward dumps is still exactly its own rows."""

import torch

from sglang.srt.hidden_states_dump.host_buffers import HostBuffers
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import (RESERVE_BYTES, assert_dumped, prompt, run_forward, start_dumper,
                                      wait_for_free_regions, wait_for_manifest, wait_for_writer)

MIB = 1 << 20


def free_bytes(pool: HostBuffers) -> int:
    return sum(size for _, size in pool.free_regions())


def test_a_forwards_region_comes_back_once_every_file_reading_it_is_written(dump_dir):
    dumper = start_dumper(dump_dir, [1, 2])
    pool = dumper.host_buffers
    assert pool.free_regions() == [(0, RESERVE_BYTES)]

    # Forward 1: "whole" ends here, "chunked" goes on in forward 2 (a forward without
    # it would discard it).
    run_forward(dumper, [(DumpRequest("whole", 3), prompt(100, 3), 0),
                         (DumpRequest("chunked", 5), prompt(200, 3), 0)])
    wait_for_manifest(dump_dir, ["whole"])
    assert free_bytes(pool) < RESERVE_BYTES  # "chunked" still reads forward 1's region

    run_forward(dumper, [(DumpRequest("chunked", 5), prompt(203, 2), 3)])
    wait_for_manifest(dump_dir, ["chunked"])
    for i in range(5):
        run_forward(dumper, [(DumpRequest(f"later-{i}", 4), prompt(300 + 10 * i, 4), 0)])
    lines = wait_for_writer(dumper, dump_dir)
    wait_for_free_regions(dumper, [(0, RESERVE_BYTES)])  # every region back, merged
    assert pool.overflows == 0 and dumper.counters().host_overflows == 0

    expected = {"whole": prompt(100, 3), "chunked": prompt(200, 5),
                **{f"later-{i}": prompt(300 + 10 * i, 4) for i in range(5)}}
    assert [line["rid"] for line in lines] == list(expected)
    for line in lines:
        assert_dumped(dump_dir, line, expected[line["rid"]], [1, 2])


def test_rows_that_find_no_room_get_memory_of_their_own_and_are_counted(dump_dir):
    # A reserve too small for one forward: every forward overflows, and still dumps its rows.
    dumper = start_dumper(dump_dir, [1, 2], reserve_bytes=4096)
    requests = {f"big-{i}": prompt(1000 + 1000 * i, 200) for i in range(3)}  # 8.8 KB of rows each
    for rid, tokens in requests.items():
        run_forward(dumper, [(DumpRequest(rid, len(tokens)), tokens, 0)])
    lines = wait_for_writer(dumper, dump_dir)
    assert dumper.host_buffers.overflows == 3 and dumper.counters().host_overflows == 3
    wait_for_free_regions(dumper, [(0, 4096)])  # the reserve was never taken for long
    for line in lines:
        assert_dumped(dump_dir, line, requests[line["rid"]], [1, 2])


def rows_of(pool: HostBuffers, mib: int):
    """Host rows of `mib` MiB in all (each tensor is 64-byte aligned in its region)."""
    return pool.rows({"token_ids": torch.empty(8, dtype=torch.int64),
                      "hidden_states": torch.empty((mib << 20) - 128, dtype=torch.uint8),
                      "last_hidden_state": torch.empty(64, dtype=torch.uint8)})


def offset_mib(pool: HostBuffers, rows) -> float:
    return (rows.token_ids.data_ptr() - pool.reserve.data_ptr()) / MIB


def test_a_forward_takes_the_smallest_free_region_that_holds_its_rows_and_free_neighbours_merge():
    pool = HostBuffers(reserve_bytes=128 * MIB, pin_memory=False)
    first, middle, last = rows_of(pool, 8), rows_of(pool, 64), rows_of(pool, 32)
    assert [offset_mib(pool, rows) for rows in (first, middle, last)] == [0, 8, 72]
    assert last.hidden_states.data_ptr() == pool.reserve.data_ptr() + 72 * MIB + 64
    assert last.last_hidden_state.data_ptr() == pool.reserve.data_ptr() + 72 * MIB + 32 * MIB - 64
    del middle
    assert pool.free_regions() == [(8 * MIB, 64 * MIB), (104 * MIB, 24 * MIB)]

    small = rows_of(pool, 17)  # the 24 MiB region holds it: not the 64
    assert offset_mib(pool, small) == 104
    assert pool.free_regions() == [(8 * MIB, 64 * MIB), (121 * MIB, 7 * MIB)]

    too_big = rows_of(pool, 65)  # no region holds it: memory of its own
    assert pool.overflows == 1
    assert not 0 <= offset_mib(pool, too_big) < 128
    del first  # merges with the free region after it
    assert pool.free_regions() == [(0, 72 * MIB), (121 * MIB, 7 * MIB)]
    del small, last, too_big
    assert pool.free_regions() == [(0, 128 * MIB)]


def test_the_reserve_is_on_the_host_whatever_the_default_device():
    # The model is built under the GPU's default device; the reserve and overflow rows
    # must still be host memory (pinning anything else raises).
    with torch.device("meta"):
        pool = HostBuffers(reserve_bytes=MIB, pin_memory=False)
        inside, outside = rows_of(pool, 1), rows_of(pool, 2)
    assert pool.reserve.device.type == "cpu"
    assert inside.hidden_states.device.type == outside.hidden_states.device.type == "cpu"
