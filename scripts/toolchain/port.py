"""make port: carry a locked release's series to a new upstream release with git's three-way merge.

start: check the versions, download TO's artifact, build the checkout .sglang/<TO>/, commit
FROM's series there on top of FROM's upstream files (files the series adds taken from
sglang_overlay/), and cherry-pick those commits onto TO's upstream. A conflict stops the
cherry-pick where git's own commands resolve it; resume goes on (continue, or skip the patch
upstream made unnecessary); abort gives the port up. Only when every patch is in does TO enter
sglang.lock, in one atomic write; patches/v<TO>/ is then written by refresh-patches.
"""

import datetime
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

import git
from unidiff import PatchSet

from scripts.toolchain import artifact, checkout
from scripts.toolchain.errors import USAGE, ToolError
from scripts.toolchain.lock import LOCK_PATH, Artifact, Lock, Release, add_release, load_lock, sha256_bytes
from scripts.toolchain.overlay import OVERLAY_DIR, read_overlay
from scripts.toolchain.refresh import with_last_update
from scripts.toolchain.series import Patch, load_series, numbered

STATE_FILE = "sglang-port.json"  # inside the checkout's .git/: a port is in progress while it exists
FROM_UPSTREAM_REF = "refs/port/from-upstream"  # FROM's upstream files
FROM_SERIES_REF = "refs/port/series"  # FROM's series, one commit per patch, on FROM_UPSTREAM_REF
DEFAULT_PYTHON = "3.11"


@dataclass
class Port:
    """A port in progress: what it carries where, kept in the TO checkout's .git/ between commands."""

    from_version: str
    release: Release  # TO as it will be locked; its files are filled in when the port completes
    patches: List[str]

    @property
    def root(self) -> Path:
        return self.release.checkout_dir

    @property
    def state_path(self) -> Path:
        return self.root / ".git" / STATE_FILE

    def save(self) -> None:
        a = self.release.artifact
        self.state_path.write_text(json.dumps({
            "from": self.from_version, "to": self.release.version, "tag": self.release.tag,
            "python": self.release.python, "patches": self.patches,
            "artifact": {"filename": a.filename, "sha256": a.sha256, "kind": a.kind},
        }, indent=1) + "\n")

    @classmethod
    def load(cls, lock_root: Path, version: str) -> Optional["Port"]:
        path = lock_root / ".sglang" / version / ".git" / STATE_FILE
        if not path.exists():
            return None
        state = json.loads(path.read_text())
        release = Release(version=state["to"], tag=state["tag"], artifact=Artifact(**state["artifact"]),
                          files={}, root=lock_root, python=state["python"])
        return cls(state["from"], release, state["patches"])


def start(from_version: str, to_version: str, python: Optional[str] = None, lock_path: Path = LOCK_PATH,
          cache_dir: Optional[Path] = None) -> str:
    lock, lock_root = load_lock(lock_path), lock_path.resolve().parent
    cache_dir = cache_dir or lock_root / ".sglang" / "artifacts"
    source = _check_versions(lock, lock_root, from_version, to_version)
    patches = load_series(source.series_dir)  # FROM's series parses before anything is fetched

    path, new_artifact = artifact.discover(to_version, python or DEFAULT_PYTHON, cache_dir)
    release = Release(version=to_version, tag=f"v{to_version}", artifact=new_artifact, files={},
                      root=lock_root, python=python or DEFAULT_PYTHON)
    checkout.build(release, release.checkout_dir, cache_dir)
    port = Port(from_version, release, [p.name for p in patches])
    port.save()

    from_tree = checkout.ensure(source, cache_dir)
    _commit_from_series(port, from_tree.root, source, patches, read_overlay(lock_root / OVERLAY_DIR))
    picked = _git(port.root, "-c", "merge.conflictStyle=diff3", "cherry-pick",
                  f"{FROM_UPSTREAM_REF}..{FROM_SERIES_REF}", check=False)
    return _finish_or_stop(port, lock_path, picked)


def resume(action: str, to_version: Optional[str] = None, lock_path: Path = LOCK_PATH) -> str:
    """action: "continue" after resolving a conflict, "skip" to drop the patch the port stopped at."""
    port = _in_progress(lock_path.resolve().parent, to_version)
    if action == "continue" and not _picking(port.root):
        picked = subprocess.CompletedProcess([], 0, "", "")  # finished with git's own commands
    else:
        picked = _git(port.root, "-c", "merge.conflictStyle=diff3", "cherry-pick", f"--{action}", check=False)
    return _finish_or_stop(port, lock_path, picked)


def abort(to_version: Optional[str] = None, lock_path: Path = LOCK_PATH) -> str:
    lock, lock_root = load_lock(lock_path), lock_path.resolve().parent
    if to_version is None:
        to_version = _in_progress(lock_root, None).release.version
    if to_version in lock.releases:
        raise ToolError(f"sglang {to_version} is locked: its checkout is not a port's to remove.", USAGE)
    root = lock_root / ".sglang" / to_version
    if not root.exists():
        return f"no port to sglang {to_version} in progress; nothing to do"
    shutil.rmtree(root)
    return f"removed {root}; sglang.lock and patches/ were never changed"


def _check_versions(lock: Lock, lock_root: Path, from_version: str, to_version: str) -> Release:
    if not from_version or not to_version:
        raise ToolError("name both releases: make port FROM=<a release in sglang.lock> TO=<the new release>.", USAGE)
    if from_version not in lock.releases:
        raise ToolError(f"FROM={from_version} is not in sglang.lock (locked: {', '.join(sorted(lock.releases))}): "
                        "a port starts from a locked release's series.", USAGE)
    if to_version in lock.releases:
        raise ToolError(f"TO={to_version} is already in sglang.lock: its series is patches/v{to_version}/; "
                        "change it in .sglang/{0}/ and run make refresh-patches SGLANG_VERSION={0}.".format(to_version),
                        USAGE)
    if Port.load(lock_root, to_version) is not None:
        raise ToolError(f"a port to sglang {to_version} is already in progress in .sglang/{to_version}/: resolve it "
                        "and run make port-continue, drop the patch it stopped at with make port-skip, or give "
                        "it up with make port-abort.", USAGE)
    if (lock_root / ".sglang" / to_version).exists():
        raise ToolError(f".sglang/{to_version}/ exists, but sglang {to_version} is not locked and no port is in "
                        f"progress (an interrupted port?): remove it with make port-abort TO={to_version}.", USAGE)
    if (lock_root / "patches" / f"v{to_version}").exists():
        raise ToolError(f"patches/v{to_version}/ exists, but sglang {to_version} is not locked: remove it first; "
                        "a port writes it with make refresh-patches once it completes.", USAGE)
    return lock.releases[from_version]


def _in_progress(lock_root: Path, to_version: Optional[str]) -> Port:
    if to_version is None:
        found = sorted(p.parent.parent.name for p in (lock_root / ".sglang").glob(f"*/.git/{STATE_FILE}"))
        if len(found) != 1:
            raise ToolError("no port is in progress." if not found else
                            f"ports to {', '.join(found)} are in progress: name one with TO=.", USAGE)
        to_version = found[0]
    port = Port.load(lock_root, to_version)
    if port is None:
        raise ToolError(f"no port to sglang {to_version} is in progress (start one with make port FROM= TO=).", USAGE)
    return port


def _commit_from_series(port: Port, from_root: Path, source: Release, patches: List[Patch],
                        overlay: Dict[str, bytes]) -> None:
    """FROM's upstream files and, on them, one commit per patch of FROM's series, under refs/port/ in
    the TO checkout: the bases git's three-way merge needs (the patches' index lines name FROM's blobs)."""
    _git(port.root, "fetch", "--quiet", "--no-tags", str(from_root), f"+refs/tags/{checkout.UPSTREAM_TAG}:{FROM_UPSTREAM_REF}")
    today = datetime.date.today().isoformat()
    with tempfile.TemporaryDirectory() as scratch:
        index = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        _git(port.root, "read-tree", FROM_UPSTREAM_REF, env=index)
        parent = _git(port.root, "rev-parse", FROM_UPSTREAM_REF).stdout.strip()
        for patch in patches:
            applied = _git(port.root, "apply", "--cached", str(source.series_dir / patch.name), env=index, check=False)
            if applied.returncode != 0:
                raise ToolError(f"{patch.name} does not apply to sglang {source.version}'s own upstream files "
                                f"({applied.stderr.strip()}): run make verify SGLANG_VERSION={source.version}.")
            for added in (f.path for f in patch.patchset if f.is_added_file and f.path in overlay):
                blob = _git(port.root, "hash-object", "-w", "--stdin", input=overlay[added]).stdout.strip()
                _git(port.root, "update-index", "--cacheinfo", f"100644,{blob},{added}", env=index)
            tree = _git(port.root, "write-tree", env=index).stdout.strip()
            message = f"{patch.stem}\n\n{with_last_update(patch.header, today)}"
            parent = _git(port.root, "commit-tree", tree, "-p", parent, "-F", "-", input=message.encode()).stdout.strip()
        _git(port.root, "update-ref", FROM_SERIES_REF, parent)


def _finish_or_stop(port: Port, lock_path: Path, picked: subprocess.CompletedProcess) -> str:
    if _picking(port.root):
        raise ToolError(_describe_stop(port, picked))
    if picked.returncode != 0:
        raise ToolError(f"git cherry-pick failed in {port.root}:\n{picked.stderr.strip()}")
    repo = git.Repo(port.root)
    if repo.is_dirty(untracked_files=False):
        raise ToolError(f"{port.root} has uncommitted changes: commit them into the patch they belong to "
                        "(git commit --amend, or a fixup) and run make port-continue.")
    commits = list(repo.iter_commits(f"{checkout.UPSTREAM_TAG}..HEAD", reverse=True))
    if not commits:
        raise ToolError(f"no patch is in {port.root} (was the cherry-pick aborted?): give the port up with "
                        f"make port-abort TO={port.release.version} and start again.")
    kept = {c.summary for c in commits}
    dropped = [name for name in port.patches if name[: -len(".patch")] not in kept]
    renumbered = _renumber(port.root, commits)
    upstream = repo.tags[checkout.UPSTREAM_TAG].commit
    touched = sorted({d.a_path for c in commits for d in c.parents[0].diff(c) if not d.new_file})
    files = {path: sha256_bytes((upstream.tree / path).data_stream.read()) for path in touched}
    release = replace(port.release, files=files)
    add_release(release, lock_path)
    port.state_path.unlink()
    for ref in (FROM_UPSTREAM_REF, FROM_SERIES_REF):
        _git(port.root, "update-ref", "-d", ref)
    return (f"ported {len(commits)} of {len(port.patches)} patches from sglang {port.from_version} to "
            f"{release.version}" + (f" (dropped: {', '.join(dropped)})" if dropped else "") +
            (f" (renumbered: {', '.join(renumbered)})" if renumbered else "") +
            f"; sglang.lock now pins {release.version} ({release.artifact.filename}, {len(files)} upstream files).\n"
            f"Next: make refresh-patches SGLANG_VERSION={release.version} writes patches/v{release.version}/.")


def _renumber(root: Path, commits: List[git.Commit]) -> List[str]:
    """Number the commits' summaries 0001, 0002, ... again, as refresh-patches wants them (a dropped
    patch leaves a gap): the same trees under new messages. Returns the summaries that changed."""
    summaries = []
    for position, commit in enumerate(commits, 1):
        name = numbered(f"{commit.summary}.patch", position)
        summaries.append(name[: -len(".patch")] if name else commit.summary)
    if summaries == [commit.summary for commit in commits]:
        return []
    parent = commits[0].parents[0].hexsha
    for commit, summary in zip(commits, summaries):
        message = summary + commit.message[len(commit.summary):]
        parent = _git(root, "commit-tree", commit.tree.hexsha, "-p", parent, "-F", "-",
                      input=message.encode()).stdout.strip()
    _git(root, "reset", "--quiet", "--soft", parent)
    return [new for new, commit in zip(summaries, commits) if new != commit.summary]


def _picking(root: Path) -> bool:
    return (root / ".git" / "CHERRY_PICK_HEAD").exists() or (root / ".git" / "sequencer").exists()


def _describe_stop(port: Port, picked: subprocess.CompletedProcess) -> str:
    repo = git.Repo(port.root)
    head = port.root / ".git" / "CHERRY_PICK_HEAD"
    if not head.exists():
        return f"the port to sglang {port.release.version} is stopped in {port.root}:\n{picked.stderr.strip()}"
    commit = repo.commit(head.read_text().strip())
    name = f"{commit.summary}.patch"
    position = port.patches.index(name) + 1 if name in port.patches else "?"
    unmerged = sorted({line.split("\t", 1)[1] for line in repo.git.ls_files("--unmerged").splitlines()})
    lines = [f"the port to sglang {port.release.version} stopped at {name} (patch {position} of {len(port.patches)}):"]
    if not unmerged:
        lines.append("  it changes nothing once upstream's changes are in (upstream made it unnecessary?), or its "
                     "conflicts are resolved but not committed.")
    for path in unmerged:
        hunks = PatchSet(repo.git.diff(commit.parents[0].hexsha, commit.hexsha, "--", path) + "\n")
        text = (port.root / path).read_text().splitlines() if (port.root / path).exists() else []
        regions = _conflict_regions(text)
        if not regions:
            lines.append(f"  {path}: conflict (added or removed on one side only)")
        named = []
        for start, base, theirs in regions:
            hunk = _hunk_in_region(hunks, base, theirs, named)
            named.append(hunk)
            lines.append(f"  {path}:{start}: " + (f"hunk {_hunk_header(hunk)} conflicts" if hunk else "conflict"))
    lines.append(
        f"Resolve it in {port.root} with git's usual commands (edit the conflicted lines, then "
        f"`git add <file>`), then run make port-continue TO={port.release.version}. If upstream made "
        f"this patch unnecessary, make port-skip TO={port.release.version} drops it; make port-abort "
        f"TO={port.release.version} gives the port up. sglang.lock and patches/ are unchanged until "
        f"every patch is in.")
    return "\n".join(lines)


def _conflict_regions(text: List[str]):
    """(first line number, base lines, their lines) of each diff3-style conflict in a file's lines."""
    regions, i = [], 0
    while i < len(text):
        if text[i].startswith("<<<<<<< "):
            start, part, base, theirs = i + 1, "ours", [], []
            i += 1
            while i < len(text) and not text[i].startswith(">>>>>>> "):
                if text[i].startswith("||||||| "):
                    part = "base"
                elif text[i] == "=======":
                    part = "theirs"
                elif part == "base":
                    base.append(text[i])
                elif part == "theirs":
                    theirs.append(text[i])
                i += 1
            regions.append((start, base, theirs))
        i += 1
    return regions


def _hunk_in_region(patched_files: PatchSet, base: List[str], theirs: List[str], named: list):
    """The patch's hunk whose changed lines the conflict holds (added lines among theirs, removed
    among base); of hunks that match as well, one not `named` for an earlier conflict."""
    best, best_score = None, (0, False)
    for patched_file in patched_files:
        for hunk in patched_file:
            added = [l.value.rstrip("\n") for l in hunk if l.is_added]
            removed = [l.value.rstrip("\n") for l in hunk if l.is_removed]
            matched = sum(line in theirs for line in added) + sum(line in base for line in removed)
            score = (matched, hunk not in named)
            if matched and score > best_score:
                best, best_score = hunk, score
    return best


def _hunk_header(hunk) -> str:
    return f"@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},{hunk.target_length} @@"


def _git(root: Path, *args, env: Optional[dict] = None, input: Optional[bytes] = None,
         check: bool = True) -> subprocess.CompletedProcess:
    """git in `root`; the port's commits carry the checkout's author, and no editor is opened."""
    identity = {"GIT_AUTHOR_NAME": checkout.AUTHOR.name, "GIT_AUTHOR_EMAIL": checkout.AUTHOR.email,
                "GIT_COMMITTER_NAME": checkout.AUTHOR.name, "GIT_COMMITTER_EMAIL": checkout.AUTHOR.email,
                "GIT_EDITOR": "true"}
    result = subprocess.run(["git", *args], cwd=root, env={**os.environ, **identity, **(env or {})},
                            input=input, capture_output=True)
    result = subprocess.CompletedProcess(result.args, result.returncode,
                                         result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace"))
    if check and result.returncode != 0:
        raise ToolError(f"git {' '.join(args[:2])} failed in {root}: {result.stderr.strip()}")
    return result
