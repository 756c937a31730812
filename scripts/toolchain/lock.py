"""sglang.lock: the upstream releases this project supports, parsed in one place."""

import hashlib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from scripts.paths import REPO_ROOT
from scripts.toolchain.errors import USAGE, ToolError

LOCK_PATH = REPO_ROOT / "sglang.lock"


@dataclass(frozen=True)
class Artifact:
    filename: str
    sha256: str
    kind: str  # "sdist" or "wheel"


@dataclass(frozen=True)
class Release:
    version: str
    tag: str
    artifact: Artifact
    # sha256 of every upstream file the series touches, keyed by path relative to the
    # package root ("sglang/srt/..."); files the series creates are not listed.
    files: Dict[str, str]
    root: Path  # the folder of the lock file, which holds patches/ and .sglang/ too
    python: str = "3.11"  # the CPython version its runtime environment needs

    @property
    def series_dir(self) -> Path:
        return self.root / "patches" / f"v{self.version}"

    @property
    def checkout_dir(self) -> Path:
        return self.root / ".sglang" / self.version


@dataclass(frozen=True)
class Lock:
    default: str
    releases: Dict[str, Release]

    def release(self, version: Optional[str]) -> Release:
        version = version or self.default
        if version not in self.releases:
            known = ", ".join(sorted(self.releases))
            raise ToolError(
                f"SGLang {version} is not in {LOCK_PATH.name} (supported: {known}).", USAGE
            )
        return self.releases[version]

    def matching_release(self, hashes: Dict[str, Optional[str]]) -> Optional[Release]:
        """The locked release whose file hashes all equal `hashes`, if any."""
        for release in self.releases.values():
            if all(hashes.get(path) == digest for path, digest in release.files.items()):
                return release
        return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_lock(path: Path = LOCK_PATH) -> Lock:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ToolError(f"{path} is missing.", USAGE)
    except tomllib.TOMLDecodeError as e:
        raise ToolError(f"{path} is not valid TOML: {e}", USAGE)
    try:
        releases = {
            version: Release(
                version=version,
                tag=entry["tag"],
                artifact=Artifact(**entry["artifact"]),
                files=dict(entry["files"]),
                root=path.resolve().parent,
                python=entry.get("python", "3.11"),
            )
            for version, entry in data["releases"].items()
        }
        lock = Lock(default=data["default"], releases=releases)
    except (KeyError, TypeError) as e:
        raise ToolError(f"{path} lacks a required key or has a wrong one: {e}", USAGE)
    lock.release(lock.default)
    return lock


def render_release(release: Release) -> str:
    """The TOML block that pins `release`, as it stands in sglang.lock."""
    name = f'releases."{release.version}"'
    artifact = release.artifact
    lines = [
        f"[{name}]", f'tag = "{release.tag}"', f'python = "{release.python}"', "",
        f"[{name}.artifact]", f'filename = "{artifact.filename}"', f'sha256 = "{artifact.sha256}"',
        f'kind = "{artifact.kind}"', "",
        f"[{name}.files]", *(f'"{path}" = "{digest}"' for path, digest in sorted(release.files.items())),
    ]
    return "\n".join(lines) + "\n"


def add_release(release: Release, path: Path = LOCK_PATH) -> None:
    """Append `release` to the lock file in one atomic replace: readers see the old file or the new one."""
    lock = load_lock(path)
    if release.version in lock.releases:
        raise ToolError(f"sglang {release.version} is already in {path.name}.", USAGE)
    text = path.read_text().rstrip("\n") + "\n\n" + render_release(release)
    tomllib.loads(text)  # the new lock parses before it replaces the old one
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv=None) -> None:
    """For the Makefile: `python -m scripts.toolchain.lock default | versions | python VERSION`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    lock = load_lock()
    if args == ["default"]:
        print(lock.default)
    elif args == ["versions"]:
        print(" ".join(lock.releases))
    elif len(args) == 2 and args[0] == "python":
        print(lock.release(args[1]).python)
    else:
        raise SystemExit("usage: python -m scripts.toolchain.lock default | versions | python VERSION")


if __name__ == "__main__":
    main()
