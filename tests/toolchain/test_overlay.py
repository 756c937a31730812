"""sglang_overlay/: one source for every file a series adds, carried into each series by refresh."""

import git
import pytest

from scripts.paths import REPO_ROOT
from scripts.toolchain import operations
from scripts.toolchain.errors import ToolError
from scripts.toolchain.lock import load_lock
from scripts.toolchain.overlay import OVERLAY_DIR, added_files, read_overlay, stale_in_series
from scripts.toolchain.series import load_series

from .helpers import DUMP_MODULE, FIXTURE_SERIES, PATCH_NAMES, replace_in, snapshot

REAL_LOCK = load_lock(REPO_ROOT / "sglang.lock")


@pytest.mark.parametrize("version", sorted(REAL_LOCK.releases))
def test_every_file_a_series_adds_equals_its_one_source(version):
    patches = load_series(REAL_LOCK.releases[version].series_dir)
    overlay = read_overlay(REPO_ROOT / OVERLAY_DIR)
    added = added_files(patches)
    assert added, f"the {version} series adds no file"
    assert sorted(added) == sorted(overlay), "a file the series adds has no source in sglang_overlay/, or the reverse"
    assert stale_in_series(patches, overlay) == [], (
        f"patches/v{version} differs from {OVERLAY_DIR}/: run make refresh-patches SGLANG_VERSION={version}")


def test_the_check_fails_for_a_series_whose_added_file_drifted(release):
    patches = load_series(FIXTURE_SERIES)
    overlay = added_files(patches)
    assert stale_in_series(patches, overlay) == []
    overlay[DUMP_MODULE] += b"# changed in the overlay only\n"
    assert stale_in_series(patches, overlay) == [DUMP_MODULE]


@pytest.fixture
def patched(pinned, lock):
    operations.apply(lock=lock)
    return pinned


def write_overlay(project, text: bytes):
    path = project / OVERLAY_DIR / DUMP_MODULE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)


def test_refresh_carries_the_overlay_into_the_commit_that_adds_the_file(patched, project, lock, release):
    source = (patched.root / DUMP_MODULE).read_bytes() + b"\n\ndef flush():\n    pass\n"
    write_overlay(project, source)
    commits_before = len(list(git.Repo(patched.root).iter_commits()))

    assert operations.refresh_patches(lock=lock) == PATCH_NAMES

    repo = git.Repo(patched.root)
    assert len(list(repo.iter_commits())) == commits_before, "the overlay change is squashed, not a new commit"
    assert not repo.is_dirty(untracked_files=True)
    assert (patched.root / DUMP_MODULE).read_bytes() == source
    patches = load_series(release.series_dir)
    assert added_files(patches)[DUMP_MODULE] == source
    assert (release.series_dir / PATCH_NAMES[1]).read_bytes() == (FIXTURE_SERIES / PATCH_NAMES[1]).read_bytes()
    assert operations.verify(lock=lock).state.kind == "applied"


def test_refresh_refuses_when_a_later_commit_changes_an_overlay_file(patched, project, lock, release):
    write_overlay(project, (patched.root / DUMP_MODULE).read_bytes())
    replace_in(patched.root / DUMP_MODULE, "import logging", "import logging  # a later edit")
    repo = git.Repo(patched.root)
    repo.git.commit("--quiet", "--all", "-m", "0004-later\n\nDescription: x\nAuthor: tests\nForwarded: no\nLast-Update: 2026-01-01")
    before = snapshot(release.series_dir)

    with pytest.raises(ToolError, match=f"edit {OVERLAY_DIR}/{DUMP_MODULE} instead"):
        operations.refresh_patches(lock=lock)
    assert snapshot(release.series_dir) == before
