"""The pinned checkout: upstream as one tagged commit, built from the locked artifact."""

import git
import pytest

from scripts.toolchain import checkout
from scripts.toolchain.errors import ToolError

from .helpers import UPSTREAM, snapshot


def test_the_pinned_checkout_is_upstream_in_one_tagged_commit(pinned, release):
    assert pinned.root == release.checkout_dir
    assert pinned.layout == "package"
    assert snapshot(pinned.root) == snapshot(UPSTREAM)
    repo = git.Repo(pinned.root)
    assert repo.head.commit == repo.tags[checkout.UPSTREAM_TAG].commit
    assert repo.head.commit.message == checkout.upstream_message(release)
    assert not repo.is_dirty(untracked_files=True)
    assert checkout.patch_commits(pinned) == []
    assert [p.name for p in release.checkout_dir.parent.iterdir()] == [release.version]  # no staging left


def test_an_existing_checkout_is_reused(pinned, release, tmp_path):
    empty_cache = tmp_path / "empty-cache"
    assert checkout.ensure(release, empty_cache) == pinned
    assert not empty_cache.exists()


def test_a_repository_that_is_not_a_pinned_checkout_is_refused(release, tmp_path):
    foreign = git.Repo.init(release.checkout_dir)
    (release.checkout_dir / "README.md").write_text("someone else's repository\n")
    foreign.git.add("--all")
    foreign.git.commit("--quiet", "-m", "unrelated")
    with pytest.raises(ToolError, match="is not a pinned checkout"):
        checkout.ensure(release, tmp_path / "cache")
