"""The writer process: it writes the files writer threads would, byte for byte and in the
same order; the rows it reads come from shared memory, overflow segments included, and go
back once written; a forward whose copy failed passes its turn; a writer process that dies
fails the files it held and every later one, counted, and nothing waits for it."""

import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.hidden_states_dump import copier, files, format
from sglang.srt.hidden_states_dump.format import read_manifest
from sglang.srt.hidden_states_dump.process_writer import ProcessDumpWriter
from sglang.srt.hidden_states_dump.requests import DumpRequest
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.hidden_states_dump.writer import DumpWriter
from tests.unit.dump_standins import (
    assert_dir_holds_exactly,
    assert_dumped,
    final_rows,
    layer_rows,
    prompt,
    run_forward,
    start_dumper,
    stats,
    submit_many,
    wait_for_manifest,
    wait_for_stats,
    wait_for_writer,
)

pytestmark = pytest.mark.same_on_every_release

LAYER_IDS = [0, 2, 4]


def test_the_writer_process_names_temporary_files_as_the_rest_of_the_dump_does():
    # files.py imports only the standard library, so it keeps its own copy of the prefix
    # that startup's stale-file removal and the readers know from format.py.
    assert files.TEMP_PREFIX == format.TEMP_PREFIX


def test_the_writer_process_writes_the_files_writer_threads_write(tmp_path):
    dumps = {}
    for writer_process in (True, False):
        dump_dir = tmp_path / f"process-{writer_process}"
        dump_dir.mkdir()
        dumper = start_dumper(dump_dir, LAYER_IDS, writer_process=writer_process)
        assert type(dumper.writer) is (ProcessDumpWriter if writer_process else DumpWriter)
        # One forward of several requests, then a prompt in two chunks.
        run_forward(dumper, [(DumpRequest(f"b{i}", 30), prompt(500 + 50 * i, 30), 0) for i in range(5)])
        run_forward(dumper, [(DumpRequest("chunked", 40), prompt(9000, 25), 0)])
        run_forward(dumper, [(DumpRequest("chunked", 40), prompt(9025, 15), 25)])
        lines = wait_for_manifest(dump_dir, ["b0", "b1", "b2", "b3", "b4", "chunked"])
        for line in lines:
            expected = prompt(9000, 40) if line["rid"] == "chunked" else prompt(500 + 50 * int(line["rid"][1:]), 30)
            assert_dumped(dump_dir, line, expected, LAYER_IDS)
        assert_dir_holds_exactly(dump_dir, lines)
        # Each file's bytes apart from its writer's run id, which names the file.
        dumps[writer_process] = [(line["rid"], (dump_dir / line["file"]).read_bytes()) for line in lines]
    assert [rid for rid, _ in dumps[True]] == [rid for rid, _ in dumps[False]]
    assert [len(data) for _, data in dumps[True]] == [len(data) for _, data in dumps[False]]
    assert [data[-4096:] for _, data in dumps[True]] == [data[-4096:] for _, data in dumps[False]]


def test_overflow_rows_cross_in_segments_of_their_own_that_go_once_written(dump_dir):
    dumper = start_dumper(dump_dir, [1, 2], reserve_bytes=4096)  # no forward fits
    requests = {f"big-{i}": prompt(1000 + 1000 * i, 200) for i in range(3)}
    for rid, tokens in requests.items():
        run_forward(dumper, [(DumpRequest(rid, len(tokens)), tokens, 0)])
    lines = wait_for_writer(dumper, dump_dir)
    assert dumper.host_buffers.overflows == 3
    for line in lines:
        assert_dumped(dump_dir, line, requests[line["rid"]], [1, 2])
    # Every overflow segment is forgotten once its file is written; the reserve stays.
    wait_for_stats(dumper, lambda _: list(dumper.host_buffers.segments) == [0])


def test_a_forward_whose_copy_failed_passes_its_turn(dump_dir, monkeypatch):
    copy = copier.RowsCopier._copy
    forwards = []

    def copy_failing_the_second(self, job, sliced):
        forwards.append(job)
        if len(forwards) == 2:
            raise RuntimeError("the copy to the host failed")
        return copy(self, job, sliced)

    monkeypatch.setattr(copier.RowsCopier, "_copy", copy_failing_the_second)
    dumper = start_dumper(dump_dir, [1])
    rids = submit_many(dumper, 5)

    counters = wait_for_stats(dumper, lambda c: c["files"] + c["errors"] == 5)
    assert counters["errors"] == 1
    lines = read_manifest(str(dump_dir))
    assert [line["rid"] for line in lines] == [rid for rid in rids if rid != "r1"]
    assert_dir_holds_exactly(dump_dir, lines)


def test_a_writer_process_that_dies_fails_every_file_and_nothing_waits(dump_dir, caplog):
    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("before", 4), prompt(100, 4), 0)])
    wait_for_manifest(dump_dir, ["before"])
    wait_for_stats(dumper, lambda c: c["files"] == 1)  # its answer read, before the kill

    os.kill(dumper.writer.process.pid, signal.SIGKILL)
    dumper.writer.process.wait()
    rids = submit_many(dumper, 6)

    counters = wait_for_stats(dumper, lambda c: c["errors"] == len(rids))
    assert counters["files"] == 1
    assert dumper.writer.drain(timeout=5) == 0  # nothing left to wait for
    assert [line["rid"] for line in read_manifest(str(dump_dir))] == ["before"]
    assert "the writer process" in caplog.text


def test_the_writer_process_outlives_the_thread_that_built_the_dumper(dump_dir):
    # Linux sends a child its parent-death signal when the thread that started it ends, so
    # a writer process started from a passing thread would be killed with that thread.
    built = []
    builder = threading.Thread(target=lambda: built.append(start_dumper(dump_dir, [1])))
    builder.start()
    builder.join()
    dumper = built[0]
    rids = submit_many(dumper, 3)
    assert [line["rid"] for line in wait_for_manifest(dump_dir, rids)] == rids
    assert dumper.writer.process.poll() is None
    assert stats(dumper)["errors"] == 0


@pytest.mark.parametrize("writer_process", [True, False])
@pytest.mark.parametrize("dtype", [None, "fp8"])
def test_rows_holding_nan_or_infinity_are_flagged_in_the_manifest_and_counted(tmp_path, writer_process, dtype):
    """One forward of two requests: a NaN in one layer of a row and an infinity in the final
    state of another row of the first; the second's rows are all finite (the control)."""
    dumper = start_dumper(tmp_path, LAYER_IDS, dtype=dtype, writer_process=writer_process)
    bad, good = prompt(700, 6), prompt(800, 5)
    token_ids = bad + good
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        hidden_states_dump_requests=[DumpRequest("bad", len(bad)), DumpRequest("good", len(good))],
        extend_prefix_lens_cpu=[0, 0], extend_seq_lens_cpu=[len(bad), len(good)],
        input_ids=torch.tensor(token_ids, dtype=torch.int32))
    aux = [layer_rows(token_ids, layer_id) for layer_id in LAYER_IDS]
    final = final_rows(token_ids)
    aux[1][2, 0] = float("nan")
    final[4, 1] = float("inf")
    dumper.capture(forward_batch, final, aux)
    lines = {line["rid"]: line for line in wait_for_manifest(tmp_path, ["bad", "good"])}
    assert {rid: line["nonfinite_rows"] for rid, line in lines.items()} == {"bad": 2, "good": 0}
    counters = wait_for_stats(dumper, lambda counters: counters["files"] == 2)
    assert counters["nonfinite"] == 1
    for line in lines.values():  # flagged, not withheld: the file is written whole, checksummed
        assert format.load_dump(str(tmp_path / line["file"]), checksum=line["checksum"]).token_ids.numel() == \
            line["num_tokens"]


def test_the_writer_process_loads_xxhash_by_its_file_alone(tmp_path):
    """The writer process runs isolated from site-packages (python -I -S): it loads xxhash's
    compiled module from the file the scheduler names, and hashes as the reader does."""
    import subprocess
    import sys

    script = (f"import sys; sys.path.insert(0, {os.path.dirname(files.__file__)!r}); import files; "
              f"files.load_xxhash(sys.argv[1]); print(files.checksum([b'abc', b'def']))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", script, files.xxhash_extension()],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == format.checksum_of([b"abcdef"])
