"""port: the fixture series carried from 0.1.0 to a synthetic 0.2.0 with git's three-way merge.

The new release is a real wheel in a local folder that pip reads instead of the package index
(PIP_NO_INDEX, PIP_FIND_LINKS), so the port downloads, hashes and unpacks it as it would a
real release, without the network.
"""

import datetime
import os
import shutil
import zipfile
from pathlib import Path

import git
import pytest

from scripts.toolchain import operations, port
from scripts.toolchain.errors import ToolError
from scripts.toolchain.lock import load_lock
from scripts.toolchain.overlay import OVERLAY_DIR, added_files
from scripts.toolchain.series import header_fields, load_series, split_header

from .helpers import DUMP_MODULE, FIXTURE_SERIES, LOGITS_PROCESSOR, MODEL, PATCH_NAMES, UPSTREAM, VERSION, replace_in, sha256_of, snapshot

NEW = "0.2.0"
WHEEL = f"sglang-{NEW}-py3-none-any.whl"
ENVIRON = "sglang/srt/environ.py"
# 0.2.0 grew a helper above everything the series patches: every hunk moves down by these lines.
MOVED_BY = "\n\ndef _unused_in_0_2_0():\n    \"\"\"New upstream code above the patched lines.\"\"\"\n    return None\n"
CONFLICTING_LINE = "        if self.capture_aux_hidden_states and forward_batch.forward_mode.is_extend():\n"


@pytest.fixture
def index(tmp_path, monkeypatch) -> Path:
    """A local stand-in for the package index, the only one pip may read."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


def publish(index: Path, tmp_path: Path, edit=lambda root: None) -> Path:
    """Put a 0.2.0 wheel of the fixture upstream on the index, its patched files moved by a few lines
    and then changed by `edit(package root)`; returns its package root."""
    root = tmp_path / f"upstream-{NEW}"
    shutil.copytree(UPSTREAM, root)
    for path in (MODEL, LOGITS_PROCESSOR):
        replace_in(root / path, "\nlogger = logging.getLogger(__name__)\n",
                   "\nlogger = logging.getLogger(__name__)\n" + MOVED_BY)
    edit(root)
    dist_info = f"sglang-{NEW}.dist-info"
    with zipfile.ZipFile(index / WHEEL, "w") as wheel:
        for path in sorted(root.rglob("*.py")):
            wheel.write(path, path.relative_to(root).as_posix())
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: sglang\nVersion: {NEW}\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return root


@pytest.fixture
def guarded(project):
    """sglang.lock and patches/ as they were before the test: a port may change them only when it completes."""
    return lambda: snapshot(project / "patches") | {"sglang.lock": sha256_of(project / "sglang.lock")}


def commits_above_upstream(root: Path):
    return list(git.Repo(root).iter_commits("upstream..HEAD", reverse=True))


def test_a_clean_port_to_a_release_whose_files_moved(pinned, project, index, tmp_path, cli):
    new_upstream = publish(index, tmp_path)
    series_copy = added_files(load_series(FIXTURE_SERIES))[DUMP_MODULE]
    (project / OVERLAY_DIR / DUMP_MODULE).parent.mkdir(parents=True)
    (project / OVERLAY_DIR / DUMP_MODULE).write_bytes(b"# the one source\n")

    code, out, err = cli("port", "--from", VERSION, "--to", NEW)

    assert (code, err) == (0, ""), err
    assert f"ported 3 of 3 patches from sglang {VERSION} to {NEW}" in out
    assert f"make refresh-patches SGLANG_VERSION={NEW}" in out
    release = load_lock(project / "sglang.lock").release(NEW)
    assert (release.tag, release.python) == (f"v{NEW}", "3.11")
    assert (release.artifact.filename, release.artifact.kind) == (WHEEL, "wheel")
    assert release.artifact.sha256 == sha256_of(index / WHEEL)
    assert release.files == {path: sha256_of(new_upstream / path) for path in (ENVIRON, LOGITS_PROCESSOR, MODEL)}
    assert load_lock(project / "sglang.lock").default == VERSION, "a port does not change the default"

    checkout = project / ".sglang" / NEW
    commits = commits_above_upstream(checkout)
    assert [c.summary for c in commits] == [name[: -len(".patch")] for name in PATCH_NAMES]
    today = datetime.date.today().isoformat()
    for commit, name in zip(commits, PATCH_NAMES):
        header, _ = split_header((project / "patches" / f"v{VERSION}" / name).read_text())
        fields = header_fields(commit.message.split("\n", 1)[1])
        assert fields == {**header_fields(header), "Last-Update": today}
    assert (checkout / DUMP_MODULE).read_bytes() == b"# the one source\n" != series_copy
    assert not git.Repo(checkout).is_dirty(untracked_files=True)
    assert not list(checkout.glob(".git/refs/port/*")), "the port's scratch refs are gone"

    assert cli("refresh-patches", "--version", NEW)[0] == 0
    patches = load_series(project / "patches" / f"v{NEW}")
    assert [p.name for p in patches] == PATCH_NAMES
    hunk = patches[1].patchset[0][1]  # `if self.capture_aux_hidden_states:` moved down by MOVED_BY's lines
    assert (hunk.source_start, hunk.target_start) == (62 + MOVED_BY.count("\n"), 63 + MOVED_BY.count("\n"))

    # The new series applies, as any locked release's does, to a fresh copy of the new upstream.
    fresh = tmp_path / "fresh"
    shutil.copytree(new_upstream, fresh)
    lock = load_lock(project / "sglang.lock")
    assert operations.verify(NEW, fresh, lock).locked
    operations.apply(NEW, fresh, lock=lock)
    for path in (ENVIRON, LOGITS_PROCESSOR, MODEL, DUMP_MODULE):
        assert (fresh / path).read_bytes() == (checkout / path).read_bytes()


def test_a_conflicting_hunk_stops_the_port_naming_it_and_continue_finishes_after_a_resolution(
        pinned, project, index, tmp_path, cli, guarded):
    publish(index, tmp_path, lambda root: replace_in(root / MODEL, "        if self.capture_aux_hidden_states:\n",
                                                     CONFLICTING_LINE))
    before = guarded()

    code, out, err = cli("port", "--from", VERSION, "--to", NEW)

    assert code == 1
    assert f"stopped at {PATCH_NAMES[1]} (patch 2 of 3)" in err
    moved = MOVED_BY.count("\n")
    assert f"{MODEL}:{66 + moved}: hunk @@ -62,7 +63,7 @@ conflicts" in err
    assert "make port-continue" in err and "make port-skip" in err
    assert guarded() == before, "sglang.lock and patches/ change only when the port completes"
    checkout = project / ".sglang" / NEW
    repo = git.Repo(checkout)
    assert [c.summary for c in commits_above_upstream(checkout)] == [PATCH_NAMES[0][: -len(".patch")]]
    assert repo.index.unmerged_blobs(), "git's own conflict state, for git's own commands"

    assert cli("port-continue")[0] == 1, "unresolved: continue stops again"
    assert guarded() == before

    text = (checkout / MODEL).read_text()
    start, end = text.index("<<<<<<< "), text.index(">>>>>>> ")
    end = text.index("\n", end) + 1
    resolved = "        if (self.capture_aux_hidden_states and forward_batch.forward_mode.is_extend()) or hidden_state_dump.enabled():\n"
    (checkout / MODEL).write_text(text[:start] + resolved + text[end:])
    repo.git.add(MODEL)

    code, out, err = cli("port-continue")
    assert (code, err) == (0, ""), err
    assert f"ported 3 of 3 patches from sglang {VERSION} to {NEW}" in out
    commits = commits_above_upstream(checkout)
    assert [c.summary for c in commits] == [name[: -len(".patch")] for name in PATCH_NAMES]
    assert header_fields(commits[1].message.split("\n", 1)[1])["Description"] == \
        "Capture aux hidden states in DeepseekV2 when dumping is on"
    assert resolved in (checkout / MODEL).read_text()
    assert NEW in load_lock(project / "sglang.lock").releases
    assert cli("refresh-patches", "--version", NEW)[0] == 0
    assert "+" + resolved in (project / "patches" / f"v{NEW}" / PATCH_NAMES[1]).read_text()


def test_a_patch_upstream_made_unnecessary_is_dropped_with_skip(pinned, project, index, tmp_path, cli):
    def upstream_did_it(root):  # what patch 0002 does, done upstream
        replace_in(root / MODEL, "        if self.capture_aux_hidden_states:\n",
                   "        if self.capture_aux_hidden_states or hidden_state_dump.enabled():\n")
        replace_in(root / MODEL, "from sglang.srt.layers.logits_processor import LogitsProcessor\n",
                   "from sglang.srt.layers import hidden_state_dump\nfrom sglang.srt.layers.logits_processor import LogitsProcessor\n")

    new_upstream = publish(index, tmp_path, upstream_did_it)

    code, _, err = cli("port", "--from", VERSION, "--to", NEW)
    assert code == 1
    assert f"stopped at {PATCH_NAMES[1]} (patch 2 of 3)" in err
    assert "changes nothing once upstream's changes are in" in err

    code, out, err = cli("port-skip", "--to", NEW)
    assert (code, err) == (0, ""), err
    assert f"ported 2 of 3 patches" in out and f"(dropped: {PATCH_NAMES[1]})" in out
    renumbered = "0002-dump-from-logits-processor"  # PATCH_NAMES[2], closing the gap 0002 left
    assert f"(renumbered: {renumbered})" in out
    checkout = project / ".sglang" / NEW
    commits = commits_above_upstream(checkout)
    assert [c.summary for c in commits] == [PATCH_NAMES[0][:-6], renumbered]
    assert header_fields(commits[1].message)["Description"] == "Hand the aux hidden states to the dump from the logits processor"
    files = load_lock(project / "sglang.lock").release(NEW).files
    assert files == {path: sha256_of(new_upstream / path) for path in (ENVIRON, LOGITS_PROCESSOR, MODEL)}

    assert cli("refresh-patches", "--version", NEW)[0] == 0
    assert (project / "patches" / f"v{NEW}" / "series").read_text() == f"{PATCH_NAMES[0]}\n{renumbered}.patch\n"


def test_an_interrupted_port_leaves_the_lock_and_patches_unchanged(pinned, project, index, tmp_path, cli, guarded,
                                                                   monkeypatch):
    publish(index, tmp_path)
    before = guarded()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(port, "_finish_or_stop", killed)  # Ctrl-C after the cherry-picks, before the lock
        cli("port", "--from", VERSION, "--to", NEW)
    assert guarded() == before

    code, _, err = cli("port", "--from", VERSION, "--to", NEW)
    assert code == 2 and f"a port to sglang {NEW} is already in progress" in err and "make port-abort" in err
    assert guarded() == before

    code, out, _ = cli("port-abort", "--to", NEW)
    assert code == 0 and "sglang.lock and patches/ were never changed" in out
    assert not (project / ".sglang" / NEW).exists()
    assert guarded() == before
    assert cli("port", "--from", VERSION, "--to", NEW)[0] == 0, "after an abort the port starts afresh"


@pytest.mark.parametrize("args, message", [
    (("--from", "0.0.9", "--to", NEW), "FROM=0.0.9 is not in sglang.lock (locked: 0.1.0)"),
    (("--from", VERSION, "--to", VERSION), f"TO={VERSION} is already in sglang.lock"),
    (("--from", VERSION, "--to", "0.3.0"), "sglang 0.3.0 was not found on the package index"),
    (("--to", NEW), "name both releases"),
])
def test_bad_input_is_a_clear_error_that_changes_nothing(pinned, project, index, tmp_path, cli, guarded, args, message):
    publish(index, tmp_path)
    before = guarded()
    sglang_dirs = sorted(p.name for p in (project / ".sglang").iterdir())
    code, out, err = cli("port", *args)
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert guarded() == before
    assert sorted(p.name for p in (project / ".sglang").iterdir()) == sglang_dirs


def test_resuming_without_a_port_in_progress_is_a_clear_error(project, cli):
    assert cli("port-continue")[:2] == (2, "")
    assert f"no port to sglang {NEW} is in progress" in cli("port-skip", "--to", NEW)[2]
