"""The locked artifact: a cached file whose sha256 differs from the lock is refused, never replaced."""

import pytest

from scripts.toolchain import artifact, checkout
from scripts.toolchain.errors import ToolError

from .helpers import sha256_of


def test_a_cached_artifact_with_the_wrong_sha256_is_refused(release, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    planted = cache / release.artifact.filename
    planted.write_bytes(b"not the sdist sglang.lock pins")

    with pytest.raises(ToolError, match="sha256") as refused:
        artifact.fetch(release, cache)
    message = str(refused.value)
    assert str(planted) in message
    assert sha256_of(planted) in message and release.artifact.sha256 in message
    assert refused.value.exit_code == 1
    assert list(cache.iterdir()) == [planted]  # pip was never asked to download anything
    assert planted.read_bytes() == b"not the sdist sglang.lock pins"


def test_no_checkout_is_built_from_a_wrong_artifact(release, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / release.artifact.filename).write_bytes(b"tampered")
    with pytest.raises(ToolError, match="sha256"):
        checkout.ensure(release, cache)
    assert not release.checkout_dir.parent.exists()


def test_the_locked_artifact_is_used_from_the_cache_and_unpacked_as_a_package_root(release, artifact_cache, tmp_path):
    path = artifact.fetch(release, artifact_cache)
    assert path == artifact_cache / release.artifact.filename
    artifact.unpack(path, tmp_path / "unpacked", release.artifact.kind)
    assert sorted(p.name for p in (tmp_path / "unpacked").iterdir()) == ["sglang"]
