"""sglang.lock: parsed in one place, naming the release a tree's files belong to."""

import pytest

from scripts.paths import REPO_ROOT
from scripts.toolchain.errors import ToolError
from scripts.toolchain.lock import load_lock
from scripts.toolchain.series import load_series

from .helpers import LOGITS_PROCESSOR as LOGITS, MODEL, lock_toml

FILES = {
    "0.4.0": {MODEL: "a" * 64, LOGITS: "b" * 64},
    "0.5.0": {MODEL: "c" * 64, LOGITS: "b" * 64},
}


@pytest.fixture
def lock_path(tmp_path):
    path = tmp_path / "sglang.lock"
    path.write_text(lock_toml("0.5.0", FILES, "d" * 64))
    return path


def test_a_lock_is_loaded_with_its_releases_next_to_it(lock_path):
    lock = load_lock(lock_path)
    assert lock.default == "0.5.0"
    release = lock.release(None)
    assert (release.version, release.tag) == ("0.5.0", "v0.5.0")
    artifact = release.artifact
    assert (artifact.filename, artifact.sha256, artifact.kind) == ("sglang-0.5.0.tar.gz", "d" * 64, "sdist")
    assert release.files == FILES["0.5.0"]
    assert release.series_dir == lock_path.parent / "patches" / "v0.5.0"
    assert release.checkout_dir == lock_path.parent / ".sglang" / "0.5.0"
    assert lock.release("0.4.0").files == FILES["0.4.0"]


def test_the_release_is_identified_by_its_file_hashes(lock_path):
    lock = load_lock(lock_path)
    assert lock.matching_release(FILES["0.4.0"]) is lock.release("0.4.0")
    assert lock.matching_release({**FILES["0.5.0"], "sglang/srt/other.py": "e" * 64}) is lock.release("0.5.0")
    assert lock.matching_release({MODEL: "c" * 64, LOGITS: "f" * 64}) is None
    assert lock.matching_release({MODEL: "c" * 64, LOGITS: None}) is None


def test_an_unknown_version_is_a_usage_error_listing_the_known_ones(lock_path):
    known = r"SGLang 9\.9\.9 is not in sglang\.lock \(supported: 0\.4\.0, 0\.5\.0\)"
    with pytest.raises(ToolError, match=known) as error:
        load_lock(lock_path).release("9.9.9")
    assert error.value.exit_code == 2


@pytest.mark.parametrize("line", ['default = "0.5.0"', 'tag = "v0.4.0"', 'sha256 = "dddd', 'kind = "sdist"'])
def test_a_missing_key_is_a_usage_error(lock_path, line):
    text = lock_path.read_text()
    lock_path.write_text("\n".join(l for l in text.splitlines() if not l.startswith(line)) + "\n")
    with pytest.raises(ToolError, match="lacks a required key") as error:
        load_lock(lock_path)
    assert error.value.exit_code == 2
    assert str(lock_path) in str(error.value)


@pytest.mark.parametrize("text, message", [
    ('default = "0.5.0"\n[releases\n', "is not valid TOML"),
    (lock_toml("0.6.0", FILES, "d" * 64), "SGLang 0.6.0 is not in"),
], ids=["invalid TOML", "default not among the releases"])
def test_a_malformed_lock_is_a_usage_error(lock_path, text, message):
    lock_path.write_text(text)
    with pytest.raises(ToolError, match=message) as error:
        load_lock(lock_path)
    assert error.value.exit_code == 2


def test_a_missing_lock_is_a_usage_error(tmp_path):
    with pytest.raises(ToolError, match="is missing") as error:
        load_lock(tmp_path / "sglang.lock")
    assert error.value.exit_code == 2


REAL_LOCK = load_lock(REPO_ROOT / "sglang.lock")


@pytest.mark.parametrize("version", sorted(REAL_LOCK.releases))
def test_the_real_lock_pins_every_upstream_file_its_series_changes(version):
    """A patch added to a series after its port (or by hand) must pin the upstream file it
    changes, or apply would take a tree whose file differs from the tested one as locked."""
    release = REAL_LOCK.releases[version]
    changed = {patched_file.path for patch in load_series(release.series_dir)
               for patched_file in patch.patchset if not patched_file.is_added_file}
    assert sorted(changed - set(release.files)) == [], f"add their sha256 to [releases.\"{version}\".files]"
