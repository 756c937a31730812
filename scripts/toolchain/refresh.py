"""Regenerate patches/<version>/ from the pinned checkout's commits, so nobody edits a diff by hand."""

import datetime
from pathlib import Path
from typing import List, Optional

import git

from scripts.toolchain.checkout import UPSTREAM_TAG, patch_commits
from scripts.toolchain.errors import ToolError
from scripts.toolchain.overlay import read_overlay, sync_checkout
from scripts.toolchain.series import NAMING_RULE, header_fields, missing_header_fields, numbered, split_header
from scripts.toolchain.tree import Tree


def render(header: str, diff: str) -> str:
    return f"{header.rstrip()}\n---\n{diff}"


def with_last_update(header: str, day: str) -> str:
    lines = [
        f"Last-Update: {day}" if line.startswith("Last-Update:") else line
        for line in header.rstrip("\n").splitlines()
    ]
    return "\n".join(lines) + "\n"


def check_names(tree: Tree, commits: List[git.Commit]) -> None:
    """Refuse commits whose summaries (the patches' stems) break the one naming rule of every release."""
    for position, commit in enumerate(commits, 1):
        name = f"{commit.summary.strip()}.patch"
        if numbered(name, position) != name:
            raise ToolError(
                f"commit {commit.hexsha[:10]} ({commit.summary.strip()}) in {tree.root} breaks the patch "
                f"naming rule: {NAMING_RULE}; as patch {position} its summary is {position:04d}-<concern>. "
                f"Reword it there (git rebase -i {UPSTREAM_TAG}) and refresh again; nothing was written."
            )


def refresh(tree: Tree, series_dir: Path, overlay_root: Optional[Path] = None) -> List[str]:
    """Write one patch per commit above upstream and the series file; returns the patch names.

    Files the series adds are first brought in line with their one source in `overlay_root`
    (the commit that adds each is amended). A patch keeps its DEP-3 header from its commit
    message; Last-Update moves to today only when the diff itself changed.
    """
    commits = patch_commits(tree)
    if not commits:
        raise ToolError(f"{tree.root} has no commits above upstream: nothing to refresh from.")
    check_names(tree, commits)
    if overlay_root is not None and sync_checkout(tree, read_overlay(overlay_root)):
        commits = patch_commits(tree)
    today = datetime.date.today().isoformat()
    rendered = {}  # every patch is rendered before any is written: a refused refresh writes nothing
    for commit in commits:
        stem = commit.summary.strip()
        header = commit.message.split("\n", 1)[1].strip("\n") + "\n" if "\n" in commit.message else ""
        missing = missing_header_fields(header)
        if missing:
            raise ToolError(
                f"commit {commit.hexsha[:10]} ({stem}) lacks DEP-3 fields {', '.join(missing)} in its message."
            )
        diff = git.Repo(tree.root).git.diff(
            commit.parents[0].hexsha, commit.hexsha, "--no-color", "--no-ext-diff", "--no-renames", "-U3"
        ) + "\n"
        name = f"{stem}.patch"
        path = series_dir / name
        if path.exists():
            old_header, old_diff = split_header(path.read_text())
            # The commit message may carry an older date than the patch (a checkout built
            # before the last refresh): an unchanged diff keeps the patch's own.
            day = today if old_diff != diff else header_fields(old_header).get("Last-Update", today)
            header = with_last_update(header, day)
        rendered[name] = render(header, diff)
    series_dir.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (series_dir / name).write_text(text)
    for stale in set(p.name for p in series_dir.glob("*.patch")) - set(rendered):
        (series_dir / stale).unlink()
    (series_dir / "series").write_text("".join(f"{name}\n" for name in rendered))
    return list(rendered)
