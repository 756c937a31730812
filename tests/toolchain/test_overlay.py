"""sglang_overlay/: one source for every file a series adds, carried into each series by refresh."""

import posixpath
import re

import git
import pytest

from scripts.paths import REPO_ROOT
from scripts.toolchain import operations
from scripts.toolchain.checkout import UPSTREAM_TAG, patch_commits
from scripts.toolchain.errors import ToolError
from scripts.toolchain.overlay import OVERLAY_DIR, added_files, read_overlay, stale_in_series
from scripts.toolchain.series import load_series

from .helpers import DUMP_MODULE, FIXTURE_SERIES, PATCH_NAMES, REAL_LOCK, VERSION, replace_in, snapshot


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


def write_overlay(project, text: bytes, path: str = DUMP_MODULE):
    full = project / OVERLAY_DIR / path
    full.parent.mkdir(parents=True, exist_ok=True)
    full.write_bytes(text)


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


# A module of a package the series might add next to DUMP_MODULE: the overlay holds several files.
NEW_MODULE = "sglang/srt/hidden_states_dump/format.py"


def test_an_overlay_identical_to_the_checkout_is_not_stale(patched, project, cli):
    write_overlay(project, (patched.package_root / DUMP_MODULE).read_bytes())
    code, out, _ = cli("verify")
    assert code == 0, out
    assert "stale" not in out
    assert "already applied; nothing to do" in cli("apply")[1]


def test_a_stale_checkout_is_reported_by_verify_and_refused_by_apply_until_refreshed(patched, project, cli):
    write_overlay(project, (patched.package_root / DUMP_MODULE).read_bytes() + b"# edited in the overlay\n")
    head = git.Repo(patched.root).head.commit
    before = snapshot(patched.root)

    code, out, _ = cli("verify")
    assert code == 1
    assert re.findall(r"^stale: .*$", out, re.MULTILINE) == [f"stale: {DUMP_MODULE}"]
    assert "state: applied: every patch of the series is in, but the tree is stale" in out

    code, out, err = cli("apply")
    assert (code, out) == (1, "")
    assert err.startswith(f"error: {patched.package_root} is stale: it does not hold {DUMP_MODULE} as {OVERLAY_DIR}/")
    assert f"Run `make refresh-patches SGLANG_VERSION={VERSION}`" in err
    assert snapshot(patched.root) == before
    assert git.Repo(patched.root).head.commit == head

    assert cli("refresh-patches")[0] == 0
    assert cli("verify")[0] == 0


def test_refresh_carries_several_overlay_files_into_the_one_commit_that_adds_them(patched, project, lock, release, cli):
    repo = git.Repo(patched.root)
    (patched.root / NEW_MODULE).parent.mkdir(parents=True)
    (patched.root / NEW_MODULE).write_bytes(b"FORMAT = 1\n")
    repo.index.add([NEW_MODULE])
    repo.git.commit("--quiet", f"--fixup={patch_commits(patched)[0].hexsha}")
    with repo.git.custom_environment(GIT_SEQUENCE_EDITOR="true"):
        repo.git.rebase("--quiet", "--interactive", "--autosquash", UPSTREAM_TAG)
    dump_module = (patched.root / DUMP_MODULE).read_bytes() + b"# edited in the overlay\n"
    write_overlay(project, dump_module)
    write_overlay(project, b"FORMAT = 2\n", NEW_MODULE)
    assert cli("verify")[0] == 1

    assert operations.refresh_patches(lock=lock) == PATCH_NAMES
    patches = load_series(release.series_dir)
    assert added_files(patches) == {DUMP_MODULE: dump_module, NEW_MODULE: b"FORMAT = 2\n"}
    assert NEW_MODULE in patches[0].paths
    assert len(patch_commits(patched)) == len(PATCH_NAMES)
    code, out, _ = cli("verify")
    assert code == 0 and "stale" not in out


def test_an_overlay_file_the_checkout_lacks_is_stale_and_refresh_asks_for_its_commit(patched, project, release, cli):
    write_overlay(project, (patched.package_root / DUMP_MODULE).read_bytes())
    write_overlay(project, b"FORMAT = 1\n", NEW_MODULE)
    series_before, checkout_before = snapshot(release.series_dir), snapshot(patched.root)

    code, out, _ = cli("verify")
    assert code == 1
    assert re.findall(r"^stale: .*$", out, re.MULTILINE) == [f"stale: {NEW_MODULE}"]
    assert cli("apply")[0] == 1

    code, _, err = cli("refresh-patches")
    assert code == 1
    assert f"{OVERLAY_DIR}/{NEW_MODULE} is a file the series adds, but no commit of {patched.root} adds" in err
    assert (snapshot(release.series_dir), snapshot(patched.root)) == (series_before, checkout_before)


def test_a_stale_tree_named_with_dir_is_refused_too(tree, project, lock, cli):
    operations.apply(sglang_dir=tree.root, lock=lock)
    write_overlay(project, b"# the overlay's version\n")
    applied = snapshot(tree.root)

    code, out, _ = cli("verify", "--dir", tree.root)
    assert code == 1 and f"stale: {DUMP_MODULE}" in out
    code, _, err = cli("apply", "--dir", tree.root)
    assert code == 1
    assert f"make revert SGLANG_VERSION={VERSION} SGLANG_DIR={tree.root}" in err
    assert f"make refresh-patches SGLANG_VERSION={VERSION}" in err
    assert snapshot(tree.root) == applied


def test_applying_a_series_older_than_the_overlay_stops_before_sglang_runs(package_tree, project, lock):
    write_overlay(project, b"# newer than patches/\n")
    with pytest.raises(ToolError, match=rf"The series is applied, but patches/v{VERSION}/ is older than {OVERLAY_DIR}/"):
        operations.apply(sglang_dir=package_tree.root, lock=lock)
    inspection = operations.verify(sglang_dir=package_tree.root, lock=lock)
    assert (inspection.state.kind, inspection.stale) == ("applied", [DUMP_MODULE])


def test_a_module_new_to_the_overlay_joins_the_commit_that_adds_its_folder(patched, project, release, cli):
    """A module added beside one the series already adds (its package) needs no commit of
    its own: refresh puts it into the patch that adds that folder's files."""
    write_overlay(project, (patched.package_root / DUMP_MODULE).read_bytes())
    sibling = posixpath.join(posixpath.dirname(DUMP_MODULE), "hidden_state_format.py")
    write_overlay(project, b"FORMAT = 1\n", sibling)

    code, _, err = cli("refresh-patches")

    assert code == 0, err
    patches = load_series(release.series_dir)
    assert added_files(patches)[sibling] == b"FORMAT = 1\n"
    def adding(path):
        return [patch.name for patch in patches for file in patch.patchset if file.path == path and file.is_added_file]

    assert adding(sibling) == adding(DUMP_MODULE) == [PATCH_NAMES[0]]
    assert cli("verify")[0] == 0
