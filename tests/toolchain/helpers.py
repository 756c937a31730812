"""The fixtures' paths, and small helpers that look at real files and run real git."""

import hashlib
import subprocess
from pathlib import Path
from typing import Dict, Tuple

from scripts.paths import REPO_ROOT
from scripts.toolchain.lock import load_lock
from scripts.toolchain.tree import Tree

REAL_LOCK = load_lock(REPO_ROOT / "sglang.lock")  # this repository's own releases and patches/
FIXTURES = Path(__file__).parent / "fixtures"
UPSTREAM = FIXTURES / "upstream"  # a package root: sglang/srt/... as a release ships it
VERSION = "0.1.0"
FIXTURE_SERIES = FIXTURES / "patches" / f"v{VERSION}"
PATCH_NAMES = [
    "0001-add-hidden-state-dump-module.patch",
    "0002-capture-aux-hidden-states-in-deepseek-v2.patch",
    "0003-dump-from-logits-processor.patch",
]
MODEL = "sglang/srt/models/deepseek_v2.py"
LOGITS_PROCESSOR = "sglang/srt/layers/logits_processor.py"
DUMP_MODULE = "sglang/srt/layers/hidden_state_dump.py"  # the file 0001 creates


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def upstream_hashes() -> Dict[str, str]:
    return {str(path.relative_to(UPSTREAM)): sha256_of(path) for path in UPSTREAM.rglob("*.py")}


def lock_toml(default: str, files_by_version: Dict[str, Dict[str, str]], artifact_sha256: str) -> str:
    """The text of an sglang.lock pinning each version's upstream files (all from one kind of sdist)."""
    lines = [f'default = "{default}"']
    for version, files in files_by_version.items():
        lines += [
            "", f'[releases."{version}"]', f'tag = "v{version}"',
            "", f'[releases."{version}".artifact]', f'filename = "sglang-{version}.tar.gz"',
            f'sha256 = "{artifact_sha256}"', 'kind = "sdist"',
            "", f'[releases."{version}".files]',
        ]
        lines += [f'"{path}" = "{digest}"' for path, digest in sorted(files.items())]
    return "\n".join(lines) + "\n"


def snapshot(root: Path) -> Dict[str, Tuple[str, int]]:
    """sha256 and permission bits of every file under root, .git/ aside."""
    return {
        str(path.relative_to(root)): (sha256_of(path), path.stat().st_mode & 0o777)
        for path in sorted(root.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(root).parts
    }


def git_apply(tree: Tree, *patches: Path) -> None:
    """Apply patches with `git apply`: an implementation independent of the one under test."""
    package_dir = tree.package_root.relative_to(tree.root)
    directory = [] if package_dir == Path(".") else [f"--directory={package_dir}"]
    subprocess.run(["git", "apply", *directory, *map(str, patches)], cwd=tree.root, check=True)


def replace_in(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}"
    path.write_text(text.replace(old, new, 1))
