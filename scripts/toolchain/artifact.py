"""The locked upstream artifact: download it, check its sha256, unpack it."""

import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import List, Tuple

from scripts.toolchain.errors import USAGE, ToolError
from scripts.toolchain.lock import Artifact, Release, sha256_file


# A wheel-only release ships compiled modules for one CPython (0.5.14: 3.12, 0.5.23: 3.11); pip
# must be told which wheel to fetch, since this may run under another Python.
def wheel_selectors(python: str) -> List[str]:
    abi = "cp" + python.replace(".", "")
    return [
        "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
        "--abi", abi, "--abi", "abi3", "--abi", "none",
        "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
        "--platform", "manylinux2014_x86_64",
        "--platform", "any",
    ]


def _pip_download(version: str, selectors: List[str], dest: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest),
           *selectors, f"sglang=={version}"]
    return subprocess.run(cmd, capture_output=True, text=True)


def fetch(release: Release, cache_dir: Path) -> Path:
    """Path of the release's artifact in cache_dir, downloaded if absent; refused on a hash mismatch."""
    artifact = release.artifact
    path = cache_dir / artifact.filename
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        selectors = ["--no-binary=:all:"] if artifact.kind == "sdist" else wheel_selectors(release.python)
        result = _pip_download(release.version, selectors, cache_dir)
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


def discover(version: str, python: str, cache_dir: Path) -> Tuple[Path, Artifact]:
    """Download a release not locked yet, its sdist if it has one, else its wheel for CPython
    `python`, into cache_dir; returns the file and the artifact to lock for it."""
    errors = []
    for kind, selectors in (("sdist", ["--no-binary=:all:"]), ("wheel", wheel_selectors(python))):
        with tempfile.TemporaryDirectory(prefix="sglang-download-") as staging:
            result = _pip_download(version, selectors, Path(staging))
            found = sorted(Path(staging).iterdir())
            if result.returncode == 0 and len(found) == 1:
                cache_dir.mkdir(parents=True, exist_ok=True)
                path = Path(shutil.move(found[0], cache_dir / found[0].name))
                return path, Artifact(filename=path.name, sha256=sha256_file(path), kind=kind)
            said = result.stderr.strip().splitlines()
            errors.append(f"{kind}: {said[-1] if said else 'nothing downloaded'}")
    raise ToolError(
        f"sglang {version} was not found on the package index (neither an sdist nor a wheel "
        f"for CPython {python}); check the version. What pip said:\n  " + "\n  ".join(errors),
        USAGE,
    )


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
