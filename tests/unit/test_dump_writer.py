"""The writer: file names that never come from request ids, threads writing side by side
with the manifest kept in submission order (a thread never waits for an earlier file's
turn), a full queue, what a write failure costs, and the timings that say where the dump's
time went."""

import os
import time

from sglang.srt.hidden_states_dump.format import TEMP_PREFIX, DumpCounters, DumpTimings, read_manifest
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import (
    WAIT_TIMEOUT_S,
    assert_dir_holds_exactly,
    assert_dumped,
    prompt,
    run_forward,
    start_dumper,
    stats,
    submit_many,
    wait_for_manifest,
    wait_for_stats,
)


HOSTILE_RIDS = [
    "../../x",
    "../escaped.safetensors",
    "/abs/path",
    "/tmp",
    "a/b\\c",
    ".",
    "..",
    "",
    " ",
    "manifest.jsonl",
    TEMP_PREFIX + "x",
    "r" * 10_240,
    "nul\x00byte",
    "new\nline\r\t",
    'quote"{}[],',
    "ünïcødé-请求-🚀-\u202eRTL",
]


def test_hostile_rids_stay_data(tmp_path):
    dump_dir = tmp_path / "a" / "b" / "dump"
    dump_dir.mkdir(parents=True)
    assert not os.path.lexists("/abs/path")
    dumper = start_dumper(dump_dir, [1, 2])
    prompts = {rid: prompt(1000 + 10 * i, 3) for i, rid in enumerate(HOSTILE_RIDS)}

    run_forward(dumper, [(DumpRequest(rid, 3), prompts[rid], 0) for rid in HOSTILE_RIDS[:8]])
    for rid in HOSTILE_RIDS[8:]:
        run_forward(dumper, [(DumpRequest(rid, 3), prompts[rid][:2], 0)])
        run_forward(dumper, [(DumpRequest(rid, 3), prompts[rid][2:], 2)])
    lines = wait_for_manifest(dump_dir, HOSTILE_RIDS)

    assert sorted(line["rid"] for line in lines) == sorted(HOSTILE_RIDS)
    for line in lines:
        assert_dumped(dump_dir, line, prompts[line["rid"]], [1, 2])
    assert_dir_holds_exactly(dump_dir, lines)
    written = [
        os.path.join(root, name) for root, _, names in os.walk(tmp_path) for name in names
    ]
    assert all(os.path.dirname(path) == str(dump_dir) for path in written)
    assert not os.path.lexists("/abs/path")
    assert stats(dumper)["errors"] == 0


def test_a_rid_that_cannot_be_encoded_costs_only_its_own_file(dump_dir):
    # A lone surrogate survives json.loads of an HTTP body but has no UTF-8 form, so
    # safetensors cannot store it: that write fails, the writer goes on.
    dumper = start_dumper(dump_dir, [1])

    run_forward(dumper, [(DumpRequest("lone-\ud800", 2), prompt(100, 2), 0)])
    run_forward(dumper, [(DumpRequest("next", 2), prompt(200, 2), 0)])
    lines = wait_for_manifest(dump_dir, ["next"])

    assert [line["rid"] for line in lines] == ["next"]
    assert stats(dumper)["errors"] == 1
    assert_dir_holds_exactly(dump_dir, lines)


def test_a_full_queue_blocks_by_default_and_loses_nothing(dump_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_QUEUE_SIZE", "1")
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])

    rids = submit_many(dumper, 30)
    lines = wait_for_manifest(dump_dir, rids)

    assert [line["rid"] for line in lines] == rids
    assert stats(dumper)["dropped"] == 0


def test_a_full_queue_in_drop_mode_drops_whole_requests(dump_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_QUEUE_SIZE", "1")
    monkeypatch.setenv("SGLANG_HS_DUMP_ON_FULL_QUEUE", "drop")
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])

    rids = submit_many(dumper, 100)
    counters = wait_for_stats(dumper, lambda c: c["files"] + c["dropped"] == 100)
    lines = read_manifest(str(dump_dir))

    # However many were dropped, each request is either whole on disk or counted.
    assert len(lines) == counters["files"]
    for line in lines:
        i = rids.index(line["rid"])
        assert_dumped(dump_dir, line, prompt(1000 + 100 * i, 64), [0, 1, 2, 3, 4])
    assert_dir_holds_exactly(dump_dir, lines)


def test_stale_temporary_files_are_removed_at_start(dump_dir):
    stale_name = "20260101T000000-00000000-000000001.safetensors"
    stale = dump_dir / (TEMP_PREFIX + stale_name)
    stale.write_bytes(b"half a file")
    kept = dump_dir / "notes.txt"
    kept.write_text("not ours")

    start_dumper(dump_dir, [1])

    assert sorted(os.listdir(dump_dir)) == ["notes.txt"]


def test_timings_say_whether_the_scheduler_waited_for_the_disk(dump_dir, monkeypatch, caplog):
    # One writer thread, a queue of one, and a disk that takes 50 ms per file: the
    # scheduler spends its time blocked on the queue, the writer its time writing.
    monkeypatch.setenv("SGLANG_HS_DUMP_QUEUE_SIZE", "1")
    monkeypatch.setenv("SGLANG_HS_DUMP_WRITER_THREADS", "1")
    fsync = os.fsync

    def slow_fsync(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(TEMP_PREFIX):
            time.sleep(0.05)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4], writer_process=False)
    rids = submit_many(dumper, 8)
    wait_for_manifest(dump_dir, rids)
    wait_for_stats(dumper, lambda counters: counters["files"] == 8)
    timings = dumper.timings()

    assert timings.write_ms >= 8 * 50
    # Eight files at 50 ms through one thread and a queue of one: the last five submits
    # each wait for a file to finish.
    assert timings.blocked_ms >= 4 * 50
    assert timings.capture_ms < timings.blocked_ms
    with caplog.at_level("INFO", logger="sglang.srt.hidden_states_dump"):
        dumper.writer.stats.log()
    logged = DumpTimings.parse(caplog.text)
    assert logged is not None and logged.write_ms >= timings.write_ms
    assert DumpCounters.parse(caplog.text).files == 8


def hold_first_file_until(monkeypatch, dump_dir, released) -> list:
    """Make the first dump file's fsync wait until `released()` holds; returns the
    listings of `dump_dir` taken while it waited (one)."""
    fsync = os.fsync
    seen_while_first_held = []

    def fsync_holding_the_first(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(TEMP_PREFIX) and name.endswith("-000000001.safetensors"):
            deadline = time.monotonic() + WAIT_TIMEOUT_S
            while not released():
                assert time.monotonic() < deadline, "the first file was never released"
                time.sleep(0.01)
            seen_while_first_held.append(sorted(os.listdir(dump_dir)))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_holding_the_first)
    return seen_while_first_held


def temp_files(dump_dir) -> list:
    return [n for n in os.listdir(dump_dir) if n.startswith(TEMP_PREFIX)]


def test_writer_threads_write_side_by_side_and_never_wait_for_an_earlier_files_turn(dump_dir, monkeypatch):
    # Four threads; the first file's fsync is held until seven later files are written.
    # Only threads that write side by side and hand a written file over, instead of
    # waiting for the first file's turn, get there (one of the other three writes at
    # least three files). None is renamed or listed before the first.
    monkeypatch.setenv("SGLANG_HS_DUMP_WRITER_THREADS", "4")
    seen = hold_first_file_until(monkeypatch, dump_dir, lambda: len(temp_files(dump_dir)) >= 8)
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4], writer_process=False)

    rids = submit_many(dumper, 12)
    lines = wait_for_manifest(dump_dir, rids)

    # Eight or more temporary files (a thread may have begun another), nothing published.
    [listing] = seen
    assert len(listing) >= 8 and all(n.startswith(TEMP_PREFIX) for n in listing)
    assert [line["rid"] for line in lines] == rids
    for i, line in enumerate(lines):
        assert_dumped(dump_dir, line, prompt(1000 + 100 * i, 64), [0, 1, 2, 3, 4])
    assert_dir_holds_exactly(dump_dir, lines)


def test_a_written_file_waiting_for_its_turn_survives_another_writer_starting(dump_dir, monkeypatch):
    # A second server (or data-parallel rank) starting on the directory removes the
    # temporary files that nobody holds; files written and waiting to be published are
    # still held.
    monkeypatch.setenv("SGLANG_HS_DUMP_WRITER_THREADS", "2")
    second_started = []
    hold_first_file_until(monkeypatch, dump_dir, lambda: bool(second_started))
    dumper = start_dumper(dump_dir, [1], writer_process=False)

    rids = submit_many(dumper, 3)
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while len(temp_files(dump_dir)) < 3:
        assert time.monotonic() < deadline, f"files 2 and 3 not written: {os.listdir(dump_dir)}"
        time.sleep(0.01)
    start_dumper(dump_dir, [1], dp_rank=1, writer_process=False)
    assert len(temp_files(dump_dir)) == 3
    second_started.append(True)
    lines = wait_for_manifest(dump_dir, rids)

    assert [line["rid"] for line in lines] == rids
    assert stats(dumper)["errors"] == 0


def test_write_all_writes_every_buffer_in_order_past_iov_max_and_short_writes(tmp_path, monkeypatch):
    from sglang.srt.hidden_states_dump import files

    buffers = [bytes([i % 251]) * (1 + i % 5) for i in range(3 * files.IOV_MAX + 7)]
    expected = b"".join(buffers)
    real_writev = os.writev
    calls = []

    def short_writev(fd, pending):  # the kernel may take a prefix of what it is given
        calls.append(len(pending))
        assert len(pending) <= files.IOV_MAX
        return real_writev(fd, [b"".join(bytes(b) for b in pending[:3])[:7]])

    for name, patched in (("whole", None), ("short", short_writev)):
        path = tmp_path / name
        if patched:
            monkeypatch.setattr(files.os, "writev", patched)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            assert files.write_all(fd, [memoryview(b) for b in buffers]) == len(expected)
        finally:
            os.close(fd)
        assert path.read_bytes() == expected, name
    # Every call was given as many buffers as one takes, and the short writes resumed.
    assert calls[0] == files.IOV_MAX and len(calls) >= len(expected) // 7
