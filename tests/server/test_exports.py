"""What both exports share (scripts/dumps/exporting.py) on a real dump: an export SIGKILLed
while it writes sample files, while it writes its index, or before its record of its
arguments is in place, and run again, ends byte for byte equal to an export never
interrupted, keeping the files it had finished; other arguments on an export's folder are
refused before anything is written; the progress bar and the summary."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.dumps import export_specforge, export_speculators
from scripts.dumps.draft_config import VALUES_NAME
from scripts.dumps.exporting import INDEX_NAME, RECORD_NAME
from scripts.paths import REPO_ROOT

EXPORTS = {"export_specforge": export_specforge, "export_speculators": export_speculators}
SAMPLE_FILES = {"export_specforge": "rows_*/data_*.ckpt", "export_speculators": "hidden_states/hs_*.safetensors"}


def tree(folder: Path) -> dict:
    """Every file under `folder`: its bytes by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def temporaries(folder: Path) -> list:
    return [p for p in folder.rglob(".*.tmp")]


def wait_for(condition, what: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Poll `condition()` until it holds; the export `process` must still run."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the export exited ({process.returncode}) before {what}: {process.stdout.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.01)


def kill_mid_export(export: str, args, gate: Path, where: str, ready) -> None:
    """Run the export stalled at `where` (tests/server/export_stall.py), wait until it holds
    there and `ready()`, then SIGKILL it."""
    gate.touch()
    process = subprocess.Popen([sys.executable, "-m", "tests.server.export_stall", str(gate), where, export, *args],
                               cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: gate.with_name(gate.name + ".holding").exists() and ready(), f"the stall at {where}", process)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL


@pytest.mark.parametrize("export", EXPORTS)
def test_an_export_killed_mid_samples_resumes_to_the_same_bytes(export_dump, tmp_path, export, capsys):
    reference, out = tmp_path / "reference", tmp_path / "out"
    assert EXPORTS[export].main([str(export_dump), str(reference)]) == 0
    capsys.readouterr()

    # Two threads: after two sample files, each stalls with a complete temporary file.
    finished = lambda: sorted(out.glob(SAMPLE_FILES[export]))
    kill_mid_export(export, [str(export_dump), str(out), "--threads", "2"], tmp_path / "gate", "samples:2",
                    lambda: len(finished()) == 2 and temporaries(out))
    kept = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished()}
    assert len(kept) == 2 and temporaries(out) and not (out / INDEX_NAME).exists()

    assert EXPORTS[export].main([str(export_dump), str(out)]) == 0
    assert "exported 3 samples (2 more done by an earlier run)" in capsys.readouterr().out
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept} == kept  # not written again
    assert temporaries(out) == []
    assert tree(out) == tree(reference)


@pytest.mark.parametrize("export", EXPORTS)
def test_an_export_killed_writing_its_index_resumes_to_the_same_bytes(export_dump, tmp_path, export, capsys):
    reference, out = tmp_path / "reference", tmp_path / "out"
    assert EXPORTS[export].main([str(export_dump), str(reference)]) == 0
    kill_mid_export(export, [str(export_dump), str(out)], tmp_path / "gate", VALUES_NAME,
                    lambda: len(list(out.glob(SAMPLE_FILES[export]))) == 5)
    assert not (out / VALUES_NAME).exists() and not (out / INDEX_NAME).exists()
    samples = {p: p.stat().st_mtime_ns for p in out.glob(SAMPLE_FILES[export])}
    capsys.readouterr()

    assert EXPORTS[export].main([str(export_dump), str(out)]) == 0
    assert "exported 0 samples (5 more done by an earlier run)" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in samples} == samples
    assert tree(out) == tree(reference)

    # Done: a third run writes nothing at all.
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert EXPORTS[export].main([str(export_dump), str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_an_export_killed_before_its_record_is_in_place_resumes(export_dump, tmp_path, capsys):
    reference, out = tmp_path / "reference", tmp_path / "out"
    assert export_specforge.main([str(export_dump), str(reference)]) == 0
    kill_mid_export("export_specforge", [str(export_dump), str(out)], tmp_path / "gate", RECORD_NAME, lambda: True)
    assert [p.name for p in out.iterdir()] == [f".{RECORD_NAME}.tmp"]

    assert export_specforge.main([str(export_dump), str(out)]) == 0
    assert tree(out) == tree(reference)


@pytest.mark.parametrize("export, other, difference", [
    ("export_specforge", ["--compress"], "--compress: false there, true now"),
    ("export_speculators", ["--layers", "0"], "--layers: [2, 0] there, [0] now"),
    ("export_speculators", ["--fp8"], "--fp8: false there, true now"),
])
def test_other_arguments_on_an_export_folder_are_refused_naming_the_difference(export_dump, tmp_path, capsys, export,
                                                                                other, difference):
    out = tmp_path / "out"
    assert EXPORTS[export].main([str(export_dump), str(out)]) == 0
    before = tree(out)
    assert EXPORTS[export].main([str(export_dump), str(out), *other]) == 1
    err = capsys.readouterr().err
    assert f"{out} holds an export made with other arguments ({difference})" in err
    assert tree(out) == before

    # Another dump's samples (here: a samples file naming fewer of them) are another export.
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(f'{{"rid": "export-{i}", "line": {i}, "num_tokens": {n}, "loss_mask": [0, {n}]}}\n'
                               for i, n in enumerate([1, 17])))
    assert EXPORTS[export].main([str(export_dump), str(out), "--samples", str(samples)]) == 1
    err = capsys.readouterr().err
    assert f'--samples: null there, "{samples}" now; samples: {{"count": 5, "sha256": ' in err
    assert '} there, {"count": 2, "sha256": ' in err
    assert tree(out) == before

    # The control: the same arguments again are a finished export.
    assert EXPORTS[export].main([str(export_dump), str(out)]) == 0


def test_a_folder_that_is_no_export_is_refused(export_dump, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert export_specforge.main([str(export_dump), str(out)]) == 1
    assert f"{out} exists and is not an export's folder (it has no {RECORD_NAME})" in capsys.readouterr().err
    assert tree(out) == {"notes.txt": b"mine"}


@pytest.mark.parametrize("export", EXPORTS)
def test_progress_and_summary(export_dump, tmp_path, capsys, export):
    out = tmp_path / "out"
    assert EXPORTS[export].main([str(export_dump), str(out)]) == 0
    captured = capsys.readouterr()
    assert "5/5" in captured.err and "read " in captured.err and "wrote " in captured.err  # the bar
    read = sum((export_dump / name).stat().st_size for name in os.listdir(export_dump) if name.endswith(".safetensors"))
    written = sum(p.stat().st_size for p in out.glob(SAMPLE_FILES[export]))
    assert "exported 5 samples in " in captured.out
    assert f"({read:,} bytes)" in captured.out and f"({written:,} bytes)" in captured.out
    assert " GB/s" in captured.out
