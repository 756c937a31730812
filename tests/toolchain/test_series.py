"""The series file and each patch: DEP-3 header, diff, and a clear usage error for a corrupt one."""

import pytest

from scripts.toolchain import operations
from scripts.toolchain.errors import ToolError
from scripts.toolchain.series import NAMING_RULE, header_fields, load_series, misnamed, numbered, read_series_names

from .helpers import FIXTURE_SERIES, PATCH_NAMES, REAL_LOCK, snapshot

MODEL_PATCH = PATCH_NAMES[1]  # two hunks: "@@ -7,6 +7,7 @@" and "@@ -62,7 +63,7 @@"


def test_the_series_is_read_in_order_without_comments_or_blank_lines():
    patches = load_series(FIXTURE_SERIES)
    assert [patch.name for patch in patches] == PATCH_NAMES
    assert [len(patch.paths) for patch in patches] == [2, 1, 2]


def test_the_dep3_header_ends_at_its_separator():
    first = load_series(FIXTURE_SERIES)[0]
    fields = header_fields(first.header)
    assert fields["Description"] == "Add the module that owns the EAGLE-3 hidden-state dump"
    assert (fields["Forwarded"], fields["Last-Update"]) == ("not-needed", "2025-06-02")
    assert " module; SGLANG_DUMP_HIDDEN_STATES_DIR (declared in Envs) turns it on.\n" in first.header
    assert "---" not in first.header


def keep_header(text: str, diff: str) -> str:
    return text.split("---\n", 1)[0] + "---\n" + diff


CORRUPTIONS = {
    "hunk counts too large": lambda text: text.replace("@@ -7,6 +7,7 @@", "@@ -7,8 +7,9 @@"),
    "hunk counts too small": lambda text: text.replace("@@ -7,6 +7,7 @@", "@@ -7,5 +7,6 @@"),
    "last hunk cut short": lambda text: text[: text.index("-        if self.capture_aux_hidden_states:")],
    "unreadable hunk header": lambda text: text.replace("@@ -7,6 +7,7 @@", "@@ -seven +7,7 @@"),
    "file header without hunks": lambda text: keep_header(text, "diff --git a/sglang/x.py b/sglang/x.py\nnot a diff\n"),
    "garbage instead of a diff": lambda text: keep_header(text, "\x00\x01 garbage\n@@ nonsense @@\n"),
    "no Forwarded field": lambda text: text.replace("Forwarded: no\n", ""),
    "neither Origin nor Author": lambda text: text.replace("Author: sglang-eagle3-dump maintainers\n", ""),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_corrupt_patch_is_a_usage_error_naming_the_patch(corrupt, package_tree, lock, release, cli):
    patch_path = release.series_dir / MODEL_PATCH
    patch_path.write_text(corrupt(patch_path.read_text()))
    before = snapshot(package_tree.root)

    with pytest.raises(ToolError) as error:
        operations.verify(sglang_dir=package_tree.root, lock=lock)
    assert error.value.exit_code == 2
    assert str(error.value).startswith(f"{patch_path}: ")

    code, out, err = cli("apply", "--dir", package_tree.root)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {patch_path}: ")
    assert snapshot(package_tree.root) == before


def test_a_patch_listed_but_missing_is_a_usage_error(package_tree, release, cli):
    (release.series_dir / MODEL_PATCH).unlink()
    code, _, err = cli("verify", "--dir", package_tree.root)
    assert code == 2
    assert f"{release.series_dir / MODEL_PATCH} is listed in series but does not exist" in err


def test_a_release_without_a_series_is_a_usage_error(package_tree, release, cli):
    (release.series_dir / "series").unlink()
    code, _, err = cli("verify", "--dir", package_tree.root)
    assert code == 2
    assert f"{release.series_dir / 'series'} is missing" in err


def test_the_naming_rule_numbers_patches_from_0001_in_series_order_without_gaps():
    assert misnamed(PATCH_NAMES) == []
    assert misnamed(["0001-a.patch", "0003-c.patch", "0004-d.patch"]) == ["0003-c.patch", "0004-d.patch"]
    assert misnamed(["0002-a.patch", "0001-b.patch"]) == ["0002-a.patch", "0001-b.patch"]
    assert misnamed(["1-a.patch", "0002-Capture_Aux.patch", "0003-c.diff", "0004-.patch"]) == [
        "1-a.patch", "0002-Capture_Aux.patch", "0003-c.diff", "0004-.patch"]
    assert numbered("0003-dump-from-logits-processor.patch", 2) == "0002-dump-from-logits-processor.patch"
    assert numbered("fix.patch", 1) is None


@pytest.mark.parametrize("version", sorted(REAL_LOCK.releases))
def test_every_release_names_its_patches_by_the_one_rule(version):
    names = read_series_names(REAL_LOCK.releases[version].series_dir)
    assert misnamed(names) == [], (
        f"patches/v{version}/series: {NAMING_RULE}. Reword the commits in .sglang/{version}/ "
        f"(git rebase -i upstream), then run make refresh-patches SGLANG_VERSION={version}.")
