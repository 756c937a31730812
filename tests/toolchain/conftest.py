"""Shared setup: real files in temporary folders and real git repositories, no mocks.

- `project`: a folder laid out like this repository (sglang.lock, patches/v0.1.0/), whose lock
  pins the fake upstream in fixtures/upstream/ and an sdist of it kept in `artifact_cache`.
- `tree`: that upstream as a package root and as a git clone (python/sglang/...), a test each.
- `pinned`: the pinned checkout project/.sglang/0.1.0/, built by scripts.toolchain.checkout from the sdist.
"""

import os
import shutil
import tarfile
from pathlib import Path

import git
import pytest

from scripts.toolchain import checkout
from scripts.toolchain.cli import main
from scripts.toolchain.lock import Lock, Release, load_lock
from scripts.toolchain.tree import Tree, locate

from .helpers import FIXTURE_SERIES, UPSTREAM, VERSION, lock_toml, sha256_of, upstream_hashes


@pytest.fixture(autouse=True)
def hermetic_git(monkeypatch):
    """git without the user's or the system's configuration, and with an identity for test commits."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "toolchain tests")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "tests@localhost")


@pytest.fixture
def artifact_cache(tmp_path) -> Path:
    """A cache already holding the release's sdist (sglang-0.1.0/sglang/...), so nothing is downloaded."""
    cache = tmp_path / "artifacts"
    cache.mkdir()
    with tarfile.open(cache / f"sglang-{VERSION}.tar.gz", "w:gz") as sdist:
        sdist.add(UPSTREAM, arcname=f"sglang-{VERSION}")
    return cache


@pytest.fixture
def project(tmp_path, artifact_cache) -> Path:
    root = tmp_path / "project"
    shutil.copytree(FIXTURE_SERIES, root / "patches" / f"v{VERSION}")
    sdist_hash = sha256_of(artifact_cache / f"sglang-{VERSION}.tar.gz")
    (root / "sglang.lock").write_text(lock_toml(VERSION, {VERSION: upstream_hashes()}, sdist_hash))
    return root


@pytest.fixture
def lock(project) -> Lock:
    return load_lock(project / "sglang.lock")


@pytest.fixture
def release(lock) -> Release:
    return lock.release(VERSION)


@pytest.fixture
def package_tree(tmp_path) -> Tree:
    root = tmp_path / "site-packages"
    shutil.copytree(UPSTREAM, root)
    return locate(root)


@pytest.fixture
def clone_tree(tmp_path) -> Tree:
    root = tmp_path / "sglang"
    shutil.copytree(UPSTREAM, root / "python")
    (root / "README.md").write_text("# SGLang\n")
    repo = git.Repo.init(root, initial_branch="main")
    repo.git.add("--all")
    repo.git.commit("--quiet", "-m", "upstream")
    return locate(root)


@pytest.fixture(params=["package", "git clone"])
def tree(request) -> Tree:
    return request.getfixturevalue({"package": "package_tree", "git clone": "clone_tree"}[request.param])


@pytest.fixture
def pinned(release, artifact_cache) -> Tree:
    return checkout.ensure(release, artifact_cache)


@pytest.fixture
def cli(project, capsys):
    """Run the command line in process against the project's lock: (exit code, stdout, stderr)."""

    def run(*args):
        code = main([*map(str, args), "--lock", str(project / "sglang.lock")])
        out, err = capsys.readouterr()
        return code, out, err

    return run
