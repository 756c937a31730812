"""Many servers, one dump directory: each writer id names its own manifest, and every
reader reads them all as one. Two writers given one id share a manifest, whose lines are
never cut by the other's startup repair."""

import fcntl
import os
import re
import threading
from pathlib import Path

import pytest

from sglang.srt.hidden_states_dump.config import DumpConfig, parse_writer_id
from sglang.srt.hidden_states_dump.format import manifest_name, manifest_paths, read_manifest
from sglang.srt.hidden_states_dump.requests import DumpRequest
from sglang.srt.hidden_states_dump.files import append_line
from sglang.srt.hidden_states_dump.writer import repair_torn_manifest
from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper
from tests.unit.dump_standins import HIDDEN_SIZE, dump_config, prompt, run_forward, stand_in_metadata, wait_for_manifest


@pytest.mark.parametrize("name", ["node-0", "host.example-7", "a" * 64, "rack 3 gpu 0", "dp", "dpx1"])
def test_a_writer_id_names_its_manifest(name):
    assert parse_writer_id(name) == name
    assert manifest_name(0, name) == f"manifest-{name}.jsonl"
    assert manifest_name(2, name) == f"manifest-{name}-dp2.jsonl"


@pytest.mark.parametrize("name, problem", [
    ("", "is empty"),
    ("a/b", "has a path separator"),
    ("..\\b", "has a path separator"),
    ("a" * 65, "is 65 characters long"),
    ("dp1", "ends like a data-parallel rank"),
    ("node-dp12", "ends like a data-parallel rank"),
    ("tab\there", "has a character that is not printable"),
])
def test_a_bad_writer_id_stops_the_server_at_startup(name, problem, monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_HS_DUMP_WRITER_ID", name)
    with pytest.raises(ValueError, match=re.escape(f"SGLANG_HS_DUMP_WRITER_ID={name!r} {problem}")):
        DumpConfig.from_env()


def test_unset_keeps_todays_names():
    assert parse_writer_id(None) is None
    assert manifest_name(0) == "manifest.jsonl" and manifest_name(3) == "manifest-dp3.jsonl"


def test_readers_take_every_writers_manifest_in_one_order(tmp_path):
    names = ["manifest-b-dp1.jsonl", "manifest-dp1.jsonl", "manifest-b.jsonl", "manifest.jsonl", "manifest-a.jsonl",
             "manifest-dp0.jsonl", "notes.jsonl"]
    for name in names:
        (tmp_path / name).write_text(f'{{"rid": "{name}", "file": "f"}}\n')
    expected = ["manifest.jsonl", "manifest-dp1.jsonl", "manifest-a.jsonl", "manifest-b.jsonl", "manifest-b-dp1.jsonl"]
    assert [Path(path).name for path in manifest_paths(str(tmp_path))] == expected
    assert [entry["rid"] for entry in read_manifest(str(tmp_path))] == expected


def start_named(dump_dir, writer_id, monkeypatch) -> HiddenStatesDumper:
    monkeypatch.setenv("SGLANG_HS_DUMP_WRITER_ID", writer_id)
    return HiddenStatesDumper(dump_config(dump_dir), stand_in_metadata([1]), is_writer=True)


def test_named_writers_share_a_directory_each_with_its_own_manifest(dump_dir, monkeypatch):
    first = start_named(dump_dir, "node-a", monkeypatch)
    run_forward(first, [(DumpRequest("a-0", 4), prompt(100, 4), 0)])
    wait_for_manifest(dump_dir, ["a-0"])
    torn = b'{"rid": "a-torn", "fi'  # node-a's manifest as if node-a were killed mid-line
    with open(dump_dir / "manifest-node-a.jsonl", "ab") as f:
        f.write(torn)

    second = start_named(dump_dir, "node-b", monkeypatch)  # repairs its own manifest only
    run_forward(second, [(DumpRequest("b-0", 4), prompt(200, 4), 0)])
    entries = wait_for_manifest(dump_dir, ["a-0", "b-0"])

    assert (dump_dir / "manifest-node-a.jsonl").read_bytes().endswith(torn)
    assert sorted(os.listdir(dump_dir)) == sorted(["manifest-node-a.jsonl", "manifest-node-b.jsonl",
                                                    *(entry["file"] for entry in entries)])
    assert all(entry["hidden_size"] == HIDDEN_SIZE for entry in entries)


def waiting_lock_on(path: Path) -> bool:
    """Whether some process waits for a lock on `path` (/proc/locks lists waiters with ->)."""
    inode = str(os.stat(path).st_ino)
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and any(re.fullmatch(r"[0-9a-f]+:[0-9a-f]+:" + inode, field) for field in fields):
            return True
    return False


def test_a_writer_starting_on_a_shared_manifest_never_cuts_a_line_being_appended(tmp_path):
    """Two servers given one writer id append to one manifest. The second's startup repair
    must wait for a line the first is appending instead of cutting it as torn."""
    manifest = tmp_path / "manifest-shared.jsonl"
    append_line(str(manifest), '{"rid": "r0", "file": "f0"}')
    with open(manifest, "ab") as appending:  # the first writer, in the middle of a line
        fcntl.flock(appending, fcntl.LOCK_EX)
        appending.write(b'{"rid": "r1", "fi')
        appending.flush()
        repair = threading.Thread(target=repair_torn_manifest, args=(str(manifest),))
        repair.start()
        while not waiting_lock_on(manifest):
            assert repair.is_alive(), "the repair ran while a line was being appended"
            os.sched_yield()
        appending.write(b'le": "f1"}\n')
        appending.flush()
        fcntl.flock(appending, fcntl.LOCK_UN)
    repair.join(30)

    assert not repair.is_alive()
    assert [entry["rid"] for entry in read_manifest(str(tmp_path))] == ["r0", "r1"]


def test_the_repair_still_cuts_a_line_no_live_writer_appends(tmp_path):
    """The negative control: with no writer holding it, a torn last line is cut."""
    manifest = tmp_path / "manifest-shared.jsonl"
    append_line(str(manifest), '{"rid": "r0", "file": "f0"}')
    with open(manifest, "ab") as f:
        f.write(b'{"rid": "r1", "fi')
    repair_torn_manifest(str(manifest))
    assert manifest.read_bytes() == b'{"rid": "r0", "file": "f0"}\n'
