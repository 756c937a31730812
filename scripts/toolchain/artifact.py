"""The locked upstream artifact: download it, check its sha256, unpack it."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from scripts.toolchain.errors import ToolError
from scripts.toolchain.lock import Release, sha256_file

# The 0.5.14 wheel contains a compiled module for CPython 3.12; pip must be told which
# wheel to fetch, since this may run under another Python.
WHEEL_SELECTORS = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    "--abi", "cp312", "--abi", "abi3", "--abi", "none",
    "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
    "--platform", "manylinux2014_x86_64",
    "--platform", "any",
]


def fetch(release: Release, cache_dir: Path) -> Path:
    """Path of the release's artifact in cache_dir, downloaded if absent; refused on a hash mismatch."""
    artifact = release.artifact
    path = cache_dir / artifact.filename
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        selectors = ["--no-binary=:all:"] if artifact.kind == "sdist" else WHEEL_SELECTORS
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(cache_dir),
               *selectors, f"sglang=={release.version}"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not path.exists():
            raise ToolError(
                f"could not download {artifact.filename} with pip:\n{result.stderr.strip()[-2000:]}"
            )
    digest = sha256_file(path)
    if digest != artifact.sha256:
        raise ToolError(
            f"{path} has sha256 {digest}, but sglang.lock pins {artifact.sha256} for "
            f"sglang {release.version}. Refusing to build from it; delete the file if it is a "
            f"broken download."
        )
    return path


def unpack(path: Path, dest: Path, kind: str) -> None:
    """Unpack to dest so that dest/sglang/ is the package."""
    dest.mkdir(parents=True)
    if kind == "sdist":
        with tarfile.open(path) as tar:
            top = tar.getnames()[0].split("/", 1)[0]
            members = []
            for member in tar.getmembers():
                if not member.name.startswith(top + "/"):
                    continue
                member.name = member.name[len(top) + 1 :]
                members.append(member)
            tar.extractall(dest, members=members, filter="data")
    else:
        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(dest)
