"""refresh: the series regenerated from the pinned checkout's commits, DEP-3 headers kept."""

import datetime

import git
import pytest

from scripts.toolchain import operations
from scripts.toolchain.errors import ToolError
from scripts.toolchain.overlay import OVERLAY_DIR
from scripts.toolchain.refresh import refresh
from scripts.toolchain.series import header_fields, split_header

from .helpers import DUMP_MODULE, FIXTURE_SERIES, LOGITS_PROCESSOR, PATCH_NAMES, UPSTREAM, replace_in, snapshot


@pytest.fixture
def patched(pinned, lock):
    """The pinned checkout with the fixture series applied: upstream plus one commit per patch."""
    operations.apply(lock=lock)
    return pinned


def test_an_unchanged_checkout_refreshes_to_the_same_bytes(patched, release):
    assert refresh(patched, release.series_dir) == PATCH_NAMES
    for name in PATCH_NAMES:
        assert (release.series_dir / name).read_bytes() == (FIXTURE_SERIES / name).read_bytes()
    assert (release.series_dir / "series").read_text() == "".join(f"{name}\n" for name in PATCH_NAMES)


def test_a_changed_commit_gets_a_new_diff_and_last_update_with_its_header_kept(patched, release, lock, package_tree):
    replace_in(patched.root / LOGITS_PROCESSOR, "submit(forward_batch, aux_pruned_states)",
               "submit(forward_batch, aux_pruned_states, logits)")
    git.Repo(patched.root).git.commit("--quiet", "--all", "--amend", "--no-edit")

    refresh(patched, release.series_dir)

    for name in PATCH_NAMES[:2]:
        assert (release.series_dir / name).read_bytes() == (FIXTURE_SERIES / name).read_bytes()
    old_header, old_diff = split_header((FIXTURE_SERIES / PATCH_NAMES[2]).read_text())
    header, diff = split_header((release.series_dir / PATCH_NAMES[2]).read_text())
    today = datetime.date.today().isoformat()
    assert header == old_header.replace("Last-Update: 2025-06-04", f"Last-Update: {today}")
    assert header_fields(header)["Description"] == "Hand the aux hidden states to the dump from the logits processor"
    assert header_fields(header)["Forwarded"] == "no"
    assert diff != old_diff
    assert "+            hidden_state_dump.submit(forward_batch, aux_pruned_states, logits)\n" in diff

    operations.apply(sglang_dir=package_tree.root, lock=lock)
    assert snapshot(package_tree.root) == snapshot(patched.root)
    operations.revert(sglang_dir=package_tree.root, lock=lock)
    assert snapshot(package_tree.root) == snapshot(UPSTREAM)


def test_a_patch_without_a_commit_leaves_the_series(patched, release):
    upstreamed = release.series_dir / "0004-fixed-upstream.patch"
    upstreamed.write_text((FIXTURE_SERIES / PATCH_NAMES[0]).read_text())
    assert refresh(patched, release.series_dir) == PATCH_NAMES
    assert not upstreamed.exists()
    assert "0004" not in (release.series_dir / "series").read_text()


def test_a_commit_without_a_dep3_header_is_refused_and_nothing_is_written(patched, release):
    (patched.root / LOGITS_PROCESSOR).write_text("# quick fix\n")
    git.Repo(patched.root).git.commit("--quiet", "--all", "-m", "0004-quick-fix")
    (release.series_dir / PATCH_NAMES[0]).unlink()  # a refresh that went ahead would write it back
    before = snapshot(release.series_dir)
    with pytest.raises(ToolError, match=r"\(0004-quick-fix\) lacks DEP-3 fields Description, Forwarded, Last-Update, Origin or Author"):
        refresh(patched, release.series_dir)
    assert snapshot(release.series_dir) == before


def test_a_checkout_without_patch_commits_has_nothing_to_refresh(pinned, release):
    before = snapshot(release.series_dir)
    with pytest.raises(ToolError, match="no commits above upstream"):
        refresh(pinned, release.series_dir)
    assert snapshot(release.series_dir) == before


def test_refresh_patches_from_the_command_line(patched, release, cli):
    (release.series_dir / PATCH_NAMES[0]).unlink()
    assert cli("refresh-patches") == (0, "wrote 3 patches and the series file\n", "")
    assert (release.series_dir / PATCH_NAMES[0]).read_bytes() == (FIXTURE_SERIES / PATCH_NAMES[0]).read_bytes()


def test_an_unchanged_diff_keeps_the_patchs_last_update_over_an_older_commit_message(patched, release):
    repo = git.Repo(patched.root)
    repo.git.commit("--quiet", "--amend", "-m", repo.head.commit.message.replace("Last-Update: 2025-06-04", "Last-Update: 2020-01-01"))
    refresh(patched, release.series_dir)
    for name in PATCH_NAMES:
        assert (release.series_dir / name).read_bytes() == (FIXTURE_SERIES / name).read_bytes()


def test_a_commit_breaking_the_naming_rule_is_refused_before_anything_is_written(patched, project, lock, release):
    repo = git.Repo(patched.root)
    repo.git.commit("--quiet", "--amend", "-m", repo.head.commit.message.replace("0003-", "0004-", 1))
    overlay_file = project / OVERLAY_DIR / DUMP_MODULE  # an overlay edit a refresh that went ahead would commit
    overlay_file.parent.mkdir(parents=True)
    overlay_file.write_bytes((patched.root / DUMP_MODULE).read_bytes() + b"# edited in the overlay\n")
    head, series_before, checkout_before = repo.head.commit, snapshot(release.series_dir), snapshot(patched.root)

    with pytest.raises(ToolError, match=rf"commit {head.hexsha[:10]} \(0004-dump-from-logits-processor\) in "
                                        rf".* breaks the patch naming rule: .* as patch 3 its summary is 0003-<concern>"):
        operations.refresh_patches(lock=lock)
    assert repo.head.commit == head
    assert (snapshot(release.series_dir), snapshot(patched.root)) == (series_before, checkout_before)
