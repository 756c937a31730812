"""The files the series adds to SGLang, each kept once in sglang_overlay/ (laid out like the
package root that holds `sglang/`) and carried into every release's series from there.

refresh-patches first makes the pinned checkout agree with the overlay: it amends the commit
that adds each file (a fixup commit squashed in by git's own autosquash), so the patch then
generated from that commit holds the file exactly as the overlay has it. Until then the
checkout is stale: verify reports its files, and apply refuses it.
"""

import posixpath
from pathlib import Path
from typing import Dict, List

import git

from scripts.toolchain.checkout import AUTHOR, UPSTREAM_TAG, patch_commits
from scripts.toolchain.errors import ToolError
from scripts.toolchain.series import Patch
from scripts.toolchain.tree import Tree

OVERLAY_DIR = "sglang_overlay"


def read_overlay(root: Path) -> Dict[str, bytes]:
    """Every file under the overlay `root`, keyed by its path relative to it ("sglang/srt/...")."""
    if not root.is_dir():
        return {}
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def added_files(patches: List[Patch]) -> Dict[str, bytes]:
    """The content of every file the series creates, as its patch writes it."""
    added = {}
    for patch in patches:
        for patched_file in patch.patchset:
            if patched_file.is_added_file:
                added[patched_file.path] = "".join(
                    line.value for hunk in patched_file for line in hunk if line.is_added
                ).encode("utf-8")
    return added


def stale_in_series(patches: List[Patch], overlay: Dict[str, bytes]) -> List[str]:
    """Files the series adds whose content differs from their one source in the overlay."""
    return sorted(path for path, data in added_files(patches).items() if path in overlay and overlay[path] != data)


def stale_in_tree(tree: Tree, overlay: Dict[str, bytes]) -> List[str]:
    """Overlay files the tree's package root lacks or holds with other bytes: an old copy would run."""
    return sorted(
        path for path, data in overlay.items()
        if not (tree.package_root / path).is_file() or (tree.package_root / path).read_bytes() != data
    )


def sync_checkout(tree: Tree, overlay: Dict[str, bytes]) -> List[str]:
    """Amend the commit that adds each overlay file so that it holds the overlay's bytes;
    returns the paths that changed. A file new to the overlay goes to the one commit that adds
    the other files of its folder (a module added to the dump's package joins the patch that
    adds the package). Every other overlay file needs a commit that adds it, and commits after
    that one must not touch it; otherwise nothing is written."""
    repo = git.Repo(tree.root)
    prefix = tree.package_root.relative_to(tree.root)
    # Each patch commit's changed paths, and whether it adds them, read once.
    changes = [(commit, _changes(commit)) for commit in patch_commits(tree)]
    adding = {}
    for path in overlay:
        repo_path = (prefix / path).as_posix()
        touching = [(commit, adds) for commit, adds in changes if repo_path in adds]
        if not touching:
            siblings = _commits_adding_into(changes, posixpath.dirname(repo_path))
            if len(siblings) == 1:
                adding[path] = siblings[0]
                continue
        if not touching or not touching[0][1][repo_path]:
            raise ToolError(
                f"{OVERLAY_DIR}/{path} is a file the series adds, but no commit of {tree.root} adds "
                f"{repo_path}: copy it there and commit it into the patch that should carry it "
                f"(git commit --fixup=<that commit>, then git rebase -i --autosquash {UPSTREAM_TAG}), "
                f"or remove it from {OVERLAY_DIR}/."
            )
        if len(touching) > 1:
            raise ToolError(
                f"{repo_path} comes from {OVERLAY_DIR}/, but commits after the one that adds it "
                f"change it too ({', '.join(commit.summary for commit, _ in touching[1:])}): edit "
                f"{OVERLAY_DIR}/{path} instead and drop those changes."
            )
        adding[path] = touching[0][0]
    changed = []
    for path, data in overlay.items():
        repo_path = (prefix / path).as_posix()
        full = tree.root / repo_path
        if full.is_file() and full.read_bytes() == data:
            continue
        full.write_bytes(data)
        repo.index.add([repo_path])
        repo.index.commit(f"fixup! {adding[path].summary}", author=AUTHOR, committer=AUTHOR)
        changed.append(path)
    if changed:
        with repo.git.custom_environment(GIT_SEQUENCE_EDITOR="true", GIT_COMMITTER_NAME=AUTHOR.name,
                                         GIT_COMMITTER_EMAIL=AUTHOR.email):
            repo.git.rebase("--interactive", "--autosquash", "--quiet", UPSTREAM_TAG)
    return changed


def _commits_adding_into(changes, folder: str) -> List[git.Commit]:
    """The commits that add a file directly inside `folder`."""
    return [commit for commit, adds in changes
            if any(added and posixpath.dirname(path) == folder for path, added in adds.items())]


def _changes(commit: git.Commit) -> Dict[str, bool]:
    """The paths a commit changes, each mapped to whether the commit adds it."""
    return {diff.b_path or diff.a_path: diff.new_file for diff in commit.parents[0].diff(commit)}
