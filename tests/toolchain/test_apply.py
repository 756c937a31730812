"""apply, revert and verify on real trees: all-or-nothing, idempotent, byte-exact, and clear about half-applied ones."""

import re
import shutil

import git
import pytest

from scripts.toolchain import operations
from scripts.toolchain.checkout import UPSTREAM_TAG, patch_commits
from scripts.toolchain.errors import ToolError
from scripts.toolchain.hunks import APPLIED, APPLIES, DRIFT
from scripts.toolchain.lock import load_lock
from scripts.toolchain.tree import locate

from .helpers import MODEL, PATCH_NAMES, VERSION, git_apply, lock_toml, replace_in, snapshot, upstream_hashes


def test_apply_then_revert_is_byte_exact_and_matches_git_apply(tree, lock, release, tmp_path):
    upstream = snapshot(tree.root)
    by_git = locate(shutil.copytree(tree.root, tmp_path / "applied-by-git"))
    git_apply(by_git, *(release.series_dir / name for name in PATCH_NAMES))

    message = operations.apply(sglang_dir=tree.root, lock=lock)
    assert message == f"applied 3 patches for sglang {VERSION} to {tree.root}"
    assert snapshot(tree.root) == snapshot(by_git.root)
    assert operations.verify(sglang_dir=tree.root, lock=lock).state.kind == "applied"

    assert operations.revert(sglang_dir=tree.root, lock=lock) == f"reverted 3 patches in {tree.root}"
    assert snapshot(tree.root) == upstream
    assert operations.verify(sglang_dir=tree.root, lock=lock).state.kind == "clean"


def test_apply_keeps_file_modes(package_tree, lock):
    model = package_tree.package_root / MODEL
    model.chmod(0o755)
    operations.apply(sglang_dir=package_tree.root, lock=lock)
    assert model.stat().st_mode & 0o777 == 0o755


def test_apply_twice_is_a_no_op(tree, cli):
    assert cli("apply", "--dir", tree.root)[0] == 0
    applied = snapshot(tree.root)
    code, out, _ = cli("apply", "--dir", tree.root)
    assert code == 0
    assert "already applied; nothing to do" in out
    assert snapshot(tree.root) == applied


def test_revert_of_a_clean_tree_is_a_no_op(tree, cli):
    upstream = snapshot(tree.root)
    code, out, _ = cli("revert", "--dir", tree.root)
    assert code == 0
    assert "nothing to do" in out
    assert snapshot(tree.root) == upstream


def test_half_applied_tree_is_detected_refused_and_reverted(tree, lock, release, cli):
    upstream = snapshot(tree.root)
    git_apply(tree, release.series_dir / PATCH_NAMES[0])
    half_applied = snapshot(tree.root)

    state = operations.verify(sglang_dir=tree.root, lock=lock).state
    assert (state.kind, state.applied_count) == ("partial", 1)
    assert [(r.patch, r.status) for r in state.reports] == [
        (PATCH_NAMES[0], APPLIED), (PATCH_NAMES[0], APPLIED),
        (PATCH_NAMES[1], APPLIES), (PATCH_NAMES[1], APPLIES),
        (PATCH_NAMES[2], APPLIES), (PATCH_NAMES[2], APPLIES), (PATCH_NAMES[2], APPLIES),
    ]
    code, out, _ = cli("verify", "--dir", tree.root)
    assert code == 1
    assert "half-applied: 1 of 3 patches are in" in out

    with pytest.raises(ToolError, match=f"half-applied: {PATCH_NAMES[0]} are in") as refused:
        operations.apply(sglang_dir=tree.root, lock=lock)
    assert refused.value.exit_code == 1
    assert snapshot(tree.root) == half_applied

    operations.revert(sglang_dir=tree.root, lock=lock)
    assert snapshot(tree.root) == upstream


def test_a_hand_edit_in_a_patched_region_is_drift_and_nothing_is_written(tree, lock, cli):
    operations.apply(sglang_dir=tree.root, lock=lock)
    replace_in(tree.package_root / MODEL, "or hidden_state_dump.enabled():", "or hidden_state_dump.is_on():")
    edited = snapshot(tree.root)

    state = operations.verify(sglang_dir=tree.root, lock=lock).state
    assert state.kind == "drift"
    assert [(r.patch, r.path, r.line) for r in state.reports if r.status == DRIFT] == [(PATCH_NAMES[1], MODEL, 62)]
    code, out, _ = cli("verify", "--dir", tree.root)
    assert code == 1
    assert re.search(rf"^{re.escape(PATCH_NAMES[1])}\s+{re.escape(MODEL)}:62\s+drift$", out, re.MULTILINE)
    assert "found:    '        if self.capture_aux_hidden_states or hidden_state_dump.is_on():\\n'" in out

    for refused_command in (operations.apply, operations.revert):
        with pytest.raises(ToolError, match="drifted") as refused:
            refused_command(sglang_dir=tree.root, lock=lock)
        assert refused.value.exit_code == 1
    assert snapshot(tree.root) == edited


def test_a_tree_that_differs_from_the_lock_needs_allow_unlocked(package_tree, lock, cli):
    replace_in(package_tree.package_root / MODEL, "with its shape but not its size", "patched by a vendor")
    vendor = snapshot(package_tree.root)

    inspection = operations.verify(sglang_dir=package_tree.root, lock=lock)
    assert (inspection.state.kind, inspection.matching_release) == ("clean", None)
    code, out, _ = cli("verify", "--dir", package_tree.root)
    assert code == 1, "verify must not call clean a tree that make apply refuses"
    assert "upstream files match no release in sglang.lock" in out
    assert "unlocked: every hunk applies, but the tree's files differ" in out
    assert cli("verify", "--dir", package_tree.root, "--allow-unlocked")[0] == 0
    code, _, err = cli("apply", "--dir", package_tree.root)
    assert code == 1
    assert "ALLOW_UNLOCKED=1" in err
    assert snapshot(package_tree.root) == vendor

    assert cli("apply", "--dir", package_tree.root, "--allow-unlocked")[0] == 0
    assert operations.verify(sglang_dir=package_tree.root, lock=lock).state.kind == "applied"
    operations.revert(sglang_dir=package_tree.root, lock=lock)
    assert snapshot(package_tree.root) == vendor


def test_without_a_version_the_release_the_tree_matches_is_chosen(package_tree, project):
    other_files = {path: "0" * 64 for path in upstream_hashes()}
    files_by_version = {"0.0.9": other_files, VERSION: upstream_hashes()}
    (project / "sglang.lock").write_text(lock_toml("0.0.9", files_by_version, "0" * 64))
    shutil.copytree(project / "patches" / f"v{VERSION}", project / "patches" / "v0.0.9")
    lock = load_lock(project / "sglang.lock")

    inspection = operations.verify(sglang_dir=package_tree.root, lock=lock)
    assert inspection.release.version == VERSION
    assert inspection.matching_release is lock.release(VERSION)


def test_pinned_checkout_gets_one_commit_per_patch_and_reverts_to_upstream(pinned, lock, release, tmp_path):
    upstream = snapshot(pinned.root)
    by_git = locate(shutil.copytree(pinned.root, tmp_path / "applied-by-git"))
    git_apply(by_git, *(release.series_dir / name for name in PATCH_NAMES))

    operations.apply(lock=lock)
    commits = patch_commits(pinned)
    assert [commit.summary for commit in commits] == [name.removesuffix(".patch") for name in PATCH_NAMES]
    assert all("Forwarded:" in commit.message for commit in commits)
    assert snapshot(pinned.root) == snapshot(by_git.root)
    repo = git.Repo(pinned.root)
    assert not repo.is_dirty(untracked_files=True)
    assert "already applied" in operations.apply(lock=lock)
    assert len(patch_commits(pinned)) == 3

    operations.revert(lock=lock)
    assert repo.head.commit == repo.tags[UPSTREAM_TAG].commit
    assert snapshot(pinned.root) == upstream
    assert operations.verify(lock=lock).state.kind == "clean"


def test_verify_without_a_pinned_checkout_asks_for_make_apply(lock, release):
    with pytest.raises(ToolError, match="run make apply first"):
        operations.verify(lock=lock)
    assert not release.checkout_dir.exists()


def test_pinned_checkout_with_another_version_of_the_series_is_reset_by_revert(pinned, lock, release):
    upstream = snapshot(pinned.root)
    operations.apply(lock=lock)
    repo = git.Repo(pinned.root)
    # A commit on top that rewrites a line the series added stands for an older (or not yet
    # refreshed) version of the series.
    patch = (release.series_dir / PATCH_NAMES[0]).read_text()
    path = next(line[len("+++ b/"):] for line in patch.splitlines() if line.startswith("+++ b/"))
    added = next(line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++"))
    target = pinned.root / path
    target.write_text(target.read_text().replace(added, added + "  # as an older series had it", 1))
    repo.index.add([path])
    repo.index.commit("0004-older\n\nDescription: x\nAuthor: tests\nForwarded: no\nLast-Update: 2026-01-01\n")
    old_head = repo.head.commit.hexsha

    with pytest.raises(ToolError, match="make revert"):
        operations.apply(lock=lock)
    target.write_text(target.read_text() + "# an uncommitted edit\n")
    with pytest.raises(ToolError, match="uncommitted"):
        operations.revert(lock=lock)
    repo.head.reset(index=True, working_tree=True)

    assert old_head[:12] in operations.revert(lock=lock)
    assert snapshot(pinned.root) == upstream
    operations.apply(lock=lock)
    assert operations.verify(lock=lock).state.kind == "applied"
