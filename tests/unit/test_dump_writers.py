"""Several writers on one dump directory, as under DP attention, where attention-TP rank 0
of every data-parallel rank writes: each appends to and repairs only its own manifest,
removes at startup only the temporary files no live writer holds, and read_manifest reads
them all as one. Each writer is its own process, as each DP rank's scheduler is."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang.srt.hidden_states_dump.format import TEMP_PREFIX, manifest_name, read_manifest
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import (
    WAIT_TIMEOUT_S,
    assert_dir_holds_exactly,
    assert_dumped,
    prompt,
    run_forward,
    start_dumper,
    wait_for_manifest,
)

pytestmark = pytest.mark.same_on_every_release

LAYER_IDS = [1, 3]
REQUESTS = 12
HELD_FILE = 3  # a held writer stops inside the fsync of its third file


def tokens_of(rid: str) -> list:
    """Distinct prompts across every writer: the rid says which."""
    rank, run, index = rid.split("-")
    return prompt(100_000 * int(rank[2:]) + 10_000 * (run == "again") + 100 * int(index), 40)


def write_as_rank(dump_dir: str, rank: str, run: str, count: str, control_dir: str) -> None:
    """A writer process: dumps `count` requests as data-parallel rank `rank`. While
    <control_dir>/hold-<rank> exists, its HELD_FILE-th file stops inside its fsync (the
    temporary file written, locked and not yet renamed), after creating holding-<rank>."""
    control, fsync, synced = Path(control_dir), os.fsync, []

    def fsync_or_hold(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.startswith(TEMP_PREFIX):
            synced.append(name)
            if len(synced) == HELD_FILE and (control / f"hold-{rank}").exists():
                (control / f"holding-{rank}").touch()
                while (control / f"hold-{rank}").exists():
                    time.sleep(0.01)
        fsync(fd)

    os.fsync = fsync_or_hold
    dumper = start_dumper(dump_dir, LAYER_IDS, dp_rank=int(rank), writer_process=False)
    rids = [f"dp{rank}-{run}-{i}" for i in range(int(count))]
    for rid in rids:
        run_forward(dumper, [(DumpRequest(rid, 40), tokens_of(rid), 0)])
    wait_for_manifest(dump_dir, rids, timeout=120)


def start_writer(dump_dir: Path, control: Path, rank: int, run: str, count: int) -> subprocess.Popen:
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    return subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from tests.unit.test_dump_writers import write_as_rank; write_as_rank(*sys.argv[1:])",
         str(dump_dir), str(rank), run, str(count), str(control)],
        cwd=repo_root,
        env=dict(os.environ, PYTHONPATH=os.environ["SGLANG_CHECKOUT"], SGLANG_HS_DUMP_WRITER_THREADS="1"),
        stderr=subprocess.PIPE, text=True,
    )


def finished(writer: subprocess.Popen) -> None:
    _, stderr = writer.communicate(timeout=180)
    assert writer.returncode == 0, stderr[-3000:]


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_TIMEOUT_S * 4
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


def test_writers_sharing_a_directory_keep_to_their_own_files(dump_dir, tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    for rank in (1, 2):
        (control / f"hold-{rank}").touch()
    writers = {rank: start_writer(dump_dir, control, rank, "first", REQUESTS) for rank in (0, 1, 2)}
    wait_for(control / "holding-1")
    wait_for(control / "holding-2")
    finished(writers[0])

    # Rank 1 dies in the middle of a write; rank 2 is in the middle of one too.
    writers[1].send_signal(signal.SIGKILL)
    writers[1].wait()
    partials = sorted(p.name for p in dump_dir.iterdir() if p.name.startswith(TEMP_PREFIX))
    assert len(partials) == 2, partials
    others = {name: (dump_dir / name).read_bytes() for name in (manifest_name(0), manifest_name(2))}

    # Rank 1 starts again on the same directory while rank 2 still writes.
    (control / "hold-1").unlink()
    finished(start_writer(dump_dir, control, 1, "again", 4))
    assert {name: (dump_dir / name).read_bytes() for name in others} == others, \
        "a starting writer changed another writer's manifest"
    left = sorted(p.name for p in dump_dir.iterdir() if p.name.startswith(TEMP_PREFIX))
    assert len(left) == 1 and left[0] in partials, "the live writer's file must stay, the dead one's go"

    (control / "hold-2").unlink()
    finished(writers[2])

    lines = read_manifest(str(dump_dir))
    rids = [line["rid"] for line in lines]
    expected = ([f"dp0-first-{i}" for i in range(REQUESTS)]
                + [f"dp1-first-{i}" for i in range(HELD_FILE - 1)] + [f"dp1-again-{i}" for i in range(4)]
                + [f"dp2-first-{i}" for i in range(REQUESTS)])
    assert rids == expected, "each rank's manifest in its order, rank 0 first; the killed rank lost its unwritten requests"
    for line in lines:
        assert_dumped(dump_dir, line, tokens_of(line["rid"]), LAYER_IDS)
    assert_dir_holds_exactly(dump_dir, lines, manifests=[manifest_name(rank) for rank in (0, 1, 2)])


def test_read_manifest_orders_writers_by_rank(dump_dir):
    for rank in (10, 2, 0):
        (dump_dir / manifest_name(rank)).write_text(f'{{"rid": "r{rank}", "file": "f{rank}"}}\n')
    (dump_dir / "manifest-dp01.jsonl").write_text('{"rid": "not a writer\'s manifest"}\n')
    assert [entry["rid"] for entry in read_manifest(str(dump_dir))] == ["r0", "r2", "r10"]
