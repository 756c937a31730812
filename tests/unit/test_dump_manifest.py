"""The manifest and reading back: every line names a complete file, torn lines (a kill
or a full disk in the middle of an append) are cut or skipped, never joined to the next."""

import os
import resource
import signal
import subprocess
import sys

import pytest

from sglang.srt.hidden_states_dump.format import MANIFEST_NAME, read_manifest
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import (
    assert_dir_holds_exactly,
    assert_dumped,
    manifest_lines_strictly,
    prompt,
    run_forward,
    start_dumper,
    wait_for_manifest,
    wait_for_stats,
)

pytestmark = pytest.mark.same_on_every_release


def test_every_manifest_line_names_a_complete_file(dump_dir):
    # wait_for_manifest loads the file of every line each time it reads the manifest,
    # here while the writer is still busy with the requests after it.
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])
    rids = [f"r{i}" for i in range(40)]

    for i, rid in enumerate(rids):
        run_forward(dumper, [(DumpRequest(rid, 50), prompt(1000 + 100 * i, 50), 0)])
        if i % 5 == 0:
            wait_for_manifest(dump_dir, [], timeout=0)
    lines = wait_for_manifest(dump_dir, rids)

    assert [line["rid"] for line in lines] == rids
    assert len({line["file"] for line in lines}) == len(rids)
    assert_dir_holds_exactly(dump_dir, lines)


def test_read_manifest_skips_a_torn_last_line_only(dump_dir):
    # What a reader sees while a line is being appended, or after a kill mid-append.
    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("whole", 2), prompt(100, 2), 0)])
    wait_for_manifest(dump_dir, ["whole"])
    manifest = dump_dir / MANIFEST_NAME
    whole = manifest.read_bytes()

    manifest.write_bytes(whole + b'{"rid": "torn", "fi')
    assert [line["rid"] for line in read_manifest(str(dump_dir))] == ["whole"]

    manifest.write_bytes(b'{"rid": "torn", "fi\n' + whole)
    with pytest.raises(ValueError, match=":1:"):
        read_manifest(str(dump_dir))


def test_a_torn_manifest_line_is_cut_when_the_dumper_starts(dump_dir):
    # A server killed in the middle of appending a line, then started again.
    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("before", 2), prompt(100, 2), 0)])
    wait_for_manifest(dump_dir, ["before"])
    with open(dump_dir / MANIFEST_NAME, "ab") as f:
        f.write(b'{"rid": "killed", "file": "2026')

    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("after", 2), prompt(200, 2), 0)])
    wait_for_manifest(dump_dir, ["after"])

    lines = manifest_lines_strictly(dump_dir)
    assert [line["rid"] for line in lines] == ["before", "after"]
    assert_dumped(dump_dir, lines[1], prompt(200, 2), [1])


FULL_DISK_BYTES = 4096


def dump_onto_a_full_disk(dump_dir: str, writer_process: bool) -> None:
    """Run in a child process, as the limit is per process: RLIMIT_FSIZE caps every file
    at FULL_DISK_BYTES, a full disk that the small data files stay under and the growing
    manifest runs into, cut short in the middle of a line (in the writer process, when
    there is one). Dumps until a write fails, then lifts the limit (space freed) and
    dumps one more request, "after"."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    dumper = start_dumper(dump_dir, [1], writer_process=writer_process)
    writer = dumper.writer.process.pid if writer_process else os.getpid()
    soft, hard = resource.prlimit(writer, resource.RLIMIT_FSIZE)
    resource.prlimit(writer, resource.RLIMIT_FSIZE, (FULL_DISK_BYTES, hard))
    for i in range(FULL_DISK_BYTES):
        run_forward(dumper, [(DumpRequest(f"r{i}", 2), prompt(100 + 10 * i, 2), 0)])
        counters = wait_for_stats(dumper, lambda c: c["files"] + c["errors"] == i + 1)
        if counters["errors"]:
            break
    assert counters["errors"], "the full disk never failed a write"
    resource.prlimit(writer, resource.RLIMIT_FSIZE, (soft, hard))
    run_forward(dumper, [(DumpRequest("after", 2), prompt(90_000, 2), 0)])
    wait_for_manifest(dump_dir, ["after"])


@pytest.mark.parametrize("writer_process", [True, False], ids=["writer process", "writer threads"])
def test_a_manifest_line_cut_by_a_full_disk_does_not_spoil_the_next(dump_dir, writer_process):
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.unit.test_dump_manifest import "
            "dump_onto_a_full_disk; dump_onto_a_full_disk(sys.argv[1], sys.argv[2] == 'True')",
            str(dump_dir),
            str(writer_process),
        ],
        cwd=repo_root,
        env=dict(os.environ, PYTHONPATH=os.environ["SGLANG_CHECKOUT"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]

    lines = manifest_lines_strictly(dump_dir)
    rids = [line["rid"] for line in lines]
    # r0..r{n-1} were written, r{n} failed on the manifest, then "after".
    assert rids == [f"r{i}" for i in range(len(rids) - 1)] + ["after"]
    for line in lines[:-1]:
        assert_dumped(dump_dir, line, prompt(100 + 10 * int(line["rid"][1:]), 2), [1])
    assert_dumped(dump_dir, lines[-1], prompt(90_000, 2), [1])
    assert_dir_holds_exactly(dump_dir, lines)


def test_read_manifest_of_an_empty_directory(dump_dir):
    assert read_manifest(str(dump_dir)) == []
