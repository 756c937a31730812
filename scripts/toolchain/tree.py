"""An SGLang source tree on disk: where its package root is, and all-or-nothing file writes."""

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from scripts.toolchain.errors import USAGE, ToolError
from scripts.toolchain.hunks import Files

MARKER = Path("sglang") / "srt" / "models" / "deepseek_v2.py"


@dataclass(frozen=True)
class Tree:
    root: Path  # the folder the user named
    package_root: Path  # the folder that holds `sglang/`; patch paths are relative to it
    layout: str  # "git clone" (files under python/sglang/...) or "package" (sglang/ at the root)

    def read(self, paths: Iterable[str]) -> Files:
        files: Files = {}
        for path in paths:
            full = self.package_root / path
            files[path] = full.read_bytes().decode("utf-8").splitlines(keepends=True) if full.exists() else None
        return files

    def write(self, new: Files, old: Files) -> None:
        """Write every changed file, or none: on any failure the files already replaced are restored."""
        changed = [path for path in new if new[path] != old.get(path)]
        done = []
        try:
            for path in changed:
                _put(self.package_root / path, new[path])
                done.append(path)
        except OSError as e:
            for path in reversed(done):
                _put(self.package_root / path, old.get(path))
            raise ToolError(f"writing {path} failed ({e}); the tree was left as it was.")


def _put(full: Path, lines: Optional[list]) -> None:
    if lines is None:
        full.unlink(missing_ok=True)
        return
    full.parent.mkdir(parents=True, exist_ok=True)
    mode = full.stat().st_mode & 0o7777 if full.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=full.parent, prefix=f".{full.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write("".join(lines).encode("utf-8"))
        os.chmod(tmp, mode)
        os.replace(tmp, full)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def locate(root: Path) -> Tree:
    """Detect the layout of `root`: a git clone of sgl-project/sglang or a package root."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise ToolError(f"SGLANG_DIR={root} is not a directory.", USAGE)
    as_clone = (root / "python" / MARKER).is_file()
    as_package = (root / MARKER).is_file()
    if as_clone and as_package:
        raise ToolError(
            f"{root} holds both python/{MARKER} and {MARKER}; name the folder that contains "
            f"`sglang/` itself.",
            USAGE,
        )
    if as_clone:
        return Tree(root, root / "python", "git clone")
    if as_package:
        return Tree(root, root, "package")
    raise ToolError(
        f"{root} is not an SGLang tree: neither {MARKER} (a package root such as an unpacked "
        f"sdist or site-packages) nor python/{MARKER} (a git clone of sgl-project/sglang) exists.",
        USAGE,
    )
