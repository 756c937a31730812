"""The pinned checkout: .sglang/<version>/, a git repository holding upstream plus one commit per patch."""

import shutil
import tempfile
from pathlib import Path
from typing import List

import git

from scripts.paths import REPO_ROOT
from scripts.toolchain import artifact
from scripts.toolchain.errors import ToolError
from scripts.toolchain.hunks import Files, transform
from scripts.toolchain.lock import Release
from scripts.toolchain.series import Patch
from scripts.toolchain.tree import Tree, locate

UPSTREAM_TAG = "upstream"
ARTIFACT_CACHE = REPO_ROOT / ".sglang" / "artifacts"
AUTHOR = git.Actor("sglang-eagle3-dump", "patches@localhost")


def upstream_message(release: Release) -> str:
    return f"upstream sglang {release.version}"


def ensure(release: Release, cache_dir: Path = ARTIFACT_CACHE) -> Tree:
    """The pinned checkout of `release`, built from its locked artifact if it does not exist yet."""
    dest = release.checkout_dir
    if not (dest / ".git").exists():
        build(release, dest, cache_dir)
    repo = git.Repo(dest)
    if UPSTREAM_TAG not in repo.tags or repo.tags[UPSTREAM_TAG].commit.message.strip() != upstream_message(release):
        raise ToolError(f"{dest} is not a pinned checkout of sglang {release.version}; remove it and run make apply.")
    return locate(dest)


def build(release: Release, dest: Path, cache_dir: Path) -> None:
    path = artifact.fetch(release, cache_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        unpack_to = staging / "tree"
        artifact.unpack(path, unpack_to, release.artifact.kind)
        repo = git.Repo.init(unpack_to, initial_branch="main")
        repo.git.add("--all", "--force")
        repo.index.commit(upstream_message(release), author=AUTHOR, committer=AUTHOR)
        repo.create_tag(UPSTREAM_TAG)
        if dest.exists():
            shutil.rmtree(dest)
        unpack_to.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def commit_series(tree: Tree, files: Files, patches: List[Patch]) -> None:
    """Apply each patch as one commit (its message: the patch's stem, then its DEP-3 header).

    The caller has verified that the whole series applies; should a write or commit still
    fail, the checkout is reset to upstream.
    """
    repo = git.Repo(tree.root)
    try:
        for patch in patches:
            ok, new_files, _ = transform(files, patch)
            assert ok, f"{patch.name} was verified but no longer applies"
            tree.write(new_files, files)
            present = [p for p in patch.paths if new_files[p] is not None]
            gone = [p for p in patch.paths if new_files[p] is None]
            if present:
                repo.index.add(present)
            if gone:
                repo.index.remove(gone)
            repo.index.commit(f"{patch.stem}\n\n{patch.header}", author=AUTHOR, committer=AUTHOR)
            files = new_files
    except BaseException:
        reset_to_upstream(tree)
        raise


def reset_to_upstream(tree: Tree) -> str:
    """Reset the checkout to its upstream commit; returns the commit it was at."""
    repo = git.Repo(tree.root)
    old_head = repo.head.commit.hexsha
    repo.head.reset(UPSTREAM_TAG, index=True, working_tree=True)
    return old_head


def has_uncommitted_changes(tree: Tree) -> bool:
    return git.Repo(tree.root).is_dirty(untracked_files=False)


def patch_commits(tree: Tree) -> List[git.Commit]:
    """The commits on top of upstream, oldest first."""
    repo = git.Repo(tree.root)
    return list(repo.iter_commits(f"{UPSTREAM_TAG}..HEAD", reverse=True))


def is_pinned(tree: Tree, release: Release) -> bool:
    return tree.root == release.checkout_dir.resolve()
