"""A real dump's integrity, end to end on one server: a row holding NaN (put into one
request's dumped rows by a fault hook) is flagged in its manifest line, counted in the dump's
log line and reported by `generate`, and the exports leave that sample out unless
--keep-nonfinite; every file's checksum is its bytes', so `inspect_dump --verify` passes the
untouched dump and names a byte flipped inside the rows, a missing and an unlisted file;
the exports refuse the flipped file by name before writing anything of it; a dump written
before checksums still reads and exports, and --verify says it has none."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.dump_format import read_manifest
from scripts.dumps import export_specforge, export_speculators, inspect_dump
from scripts.dumps.exporting import INDEX_NAME
from scripts.dumps.samples import SAMPLES_NAME, read_lines
from scripts.dumps.server import Server, runtime_env
from scripts.paths import REPO_ROOT
from tests.server.dump_checks import EXPORT_DUMP_LAYERS, dump_stats, wait_until
from tests.server.fault_hooks import poison_rows_spec

EXPORTS = {"export_specforge": export_specforge, "export_speculators": export_speculators}
SAMPLE_FILES = {"export_specforge": "rows_*/data_{idx}.ckpt", "export_speculators": "hidden_states/hs_{idx}.safetensors"}
RECORDS = [{"id": "clean-0", "text": "the first sample, as it was dumped"},
           {"id": "nan-1", "text": "a sample one of whose rows holds a NaN"},
           {"id": "clean-2", "text": "the last sample, whose file a flipped byte changes"}]


@pytest.fixture(scope="module")
def integrity_dump(model_l3, tmp_path_factory):
    """The records dumped by `generate` through a server whose dump poisons the rows of rid
    nan-1: the dump, generate's output and the server's log."""
    base = tmp_path_factory.mktemp("integrity")
    dump_dir, dataset = base / "dump", base / "records.jsonl"
    dataset.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_LAYERS=",".join(map(str, EXPORT_DUMP_LAYERS)))
    with Server(model_l3, base / "server.log", env, ["--forward-hooks", poison_rows_spec("nan-")]) as server:
        server.wait_ready()
        generated = subprocess.run(
            [sys.executable, "-m", "scripts.dumps.generate", "--dataset", str(dataset), "--out", str(dump_dir),
             "--model", str(model_l3), "--server", f"http://127.0.0.1:{server.port}"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert generated.returncode == 0, generated.stdout + generated.stderr
        # Logged at once: a sample with non-finite rows, like an error.
        wait_until(lambda: (dump_stats(server.log()) or {}).get("nonfinite") == 1, 60, "the NaN sample counted")
    return dump_dir, generated.stdout, server.log()  # with the counters logged at exit


def by_rid(dump_dir: Path) -> dict:
    return {entry["rid"]: entry for entry in read_manifest(str(dump_dir))}


def flip_a_row_byte(path: Path) -> None:
    """Flip one bit inside the file's tensor data, past its header: it still loads."""
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end + (len(data) - header_end) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_nan_row_is_flagged_counted_and_reported(integrity_dump, capsys):
    dump_dir, generated, log = integrity_dump
    entries = by_rid(dump_dir)
    assert {rid: entry["nonfinite_rows"] for rid, entry in entries.items()} == {"clean-0": 0, "nan-1": 1, "clean-2": 0}
    assert dump_stats(log)["nonfinite"] == 1 and dump_stats(log)["files"] == len(RECORDS)
    assert "request 'nan-1' has 1 of" in log and "rows holding NaN or infinity" in log
    assert "with rows that hold NaN or infinity (flagged in the manifest; the exports and the stream leave them " \
           "out): 1: 'nan-1'" in generated
    assert inspect_dump.main([str(dump_dir)]) == 0  # flagged, not broken
    out = capsys.readouterr().out
    assert "samples with rows that hold NaN or infinity (the exports and the stream skip them): 1" in out
    assert f"{entries['nan-1']['file']} (rid 'nan-1'): 1 of" in out


def test_verify_passes_the_untouched_dump_and_names_each_changed_missing_and_unlisted_file(integrity_dump, tmp_path,
                                                                                              capsys):
    dump_dir = tmp_path / "dump"
    shutil.copytree(integrity_dump[0], dump_dir)
    entries = by_rid(dump_dir)
    assert all(entry["checksum"].startswith("xxh3_128:") for entry in entries.values())
    assert inspect_dump.main([str(dump_dir), "--verify"]) == 0  # the negative control
    out = capsys.readouterr().out
    assert "files verified: 3 of 3" in out and "CHANGED" not in out

    flip_a_row_byte(dump_dir / entries["clean-2"]["file"])
    (dump_dir / entries["clean-0"]["file"]).rename(dump_dir / "20260101T000000-0badf11e-000000001.safetensors")
    assert inspect_dump.main([str(dump_dir), "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"CHANGED {entries['clean-2']['file']} (rid 'clean-2'): its bytes changed" in out
    assert f"MISSING {entries['clean-0']['file']}" in out
    assert "UNLISTED 20260101T000000-0badf11e-000000001.safetensors" in out
    assert "files verified: 1 of 2" in out  # nan-1's file is untouched


def test_a_dump_written_before_checksums_reads_and_verify_says_it_has_none(integrity_dump, tmp_path, capsys):
    dump_dir = tmp_path / "dump"
    shutil.copytree(integrity_dump[0], dump_dir)
    manifest = dump_dir / "manifest.jsonl"
    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    manifest.write_text("".join(json.dumps({k: v for k, v in line.items() if k not in ("checksum", "nonfinite_rows")})
                                + "\n" for line in lines))
    assert inspect_dump.main([str(dump_dir), "--verify"]) == 0
    assert "no checksum (written before the dump recorded them): 3 files, not verified" in capsys.readouterr().out
    assert export_speculators.main([str(dump_dir), str(tmp_path / "out")]) == 0
    assert len(read_lines(tmp_path / "out" / INDEX_NAME)) == 3  # nothing flagged in such a dump


@pytest.mark.parametrize("export", EXPORTS)
def test_the_exports_leave_out_nonfinite_samples_unless_kept_and_refuse_a_changed_file_by_name(
        integrity_dump, tmp_path, capsys, export):
    dump_dir = tmp_path / "dump"
    shutil.copytree(integrity_dump[0], dump_dir)
    assert EXPORTS[export].main([str(dump_dir), str(tmp_path / "finite")]) == 0
    assert "leaving out 1 samples whose rows hold NaN or infinity (--keep-nonfinite keeps them): 'nan-1'" in \
        capsys.readouterr().err
    # The exports keep the samples file's order (generate's samples.jsonl): a sample's line is
    # written once its answer is back and its manifest line is seen. generate sends the requests
    # side by side, so the manifest, in the order the server finished them, may list another.
    listed = [line["rid"] for line in read_lines(dump_dir / SAMPLES_NAME)]
    assert sorted(listed) == ["clean-0", "clean-2", "nan-1"]
    assert [line["rid"] for line in read_lines(tmp_path / "finite" / INDEX_NAME)] == [
        rid for rid in listed if rid != "nan-1"]
    assert EXPORTS[export].main([str(dump_dir), str(tmp_path / "kept"), "--keep-nonfinite"]) == 0
    assert [line["rid"] for line in read_lines(tmp_path / "kept" / INDEX_NAME)] == listed

    changed = by_rid(dump_dir)["clean-2"]["file"]
    flip_a_row_byte(dump_dir / changed)
    out = tmp_path / "changed"
    assert EXPORTS[export].main([str(dump_dir), str(out), "--threads", "1"]) == 1
    err = capsys.readouterr().err
    assert f"refusing {changed} (rid 'clean-2')" in err and "its bytes changed since they were written" in err
    # clean-2 is idx 1 there: nothing of it written, not even a temporary file.
    pattern = SAMPLE_FILES[export].format(idx=1)
    assert list(out.glob(pattern)) == [] and list(out.rglob(".*.tmp")) == []
    assert len(list(out.glob(SAMPLE_FILES[export].format(idx=0)))) == 1 and not (out / INDEX_NAME).exists()
