"""Hunk verification: every hunk is found where its header says, or reported as drift there."""

import re
import shutil
from pathlib import Path

import git
import pytest

from scripts.toolchain import operations
from scripts.toolchain.errors import ToolError
from scripts.toolchain.hunks import APPLIES, DRIFT, MAX_OFFSET
from scripts.toolchain.lock import load_lock
from scripts.toolchain.series import load_series

from .helpers import DUMP_MODULE, FIXTURE_SERIES, MODEL, PATCH_NAMES, VERSION, lock_toml, sha256_of, snapshot


def hunks_with_upstream_lines():
    """(patch, path, header line, index of the hunk in its patch) for every hunk that reads upstream lines."""
    cases = []
    for patch in load_series(FIXTURE_SERIES):
        hunks = [(patched_file.path, hunk) for patched_file in patch.patchset for hunk in patched_file]
        for index, (path, hunk) in enumerate(hunks):
            if hunk.source_length:
                cases.append(pytest.param(patch.name, path, hunk.source_start, index,
                                          id=f"{patch.name[:4]}-{Path(path).name}:{hunk.source_start}"))
    return cases


def mutate_hunk(patch_path: Path, index: int) -> None:
    """Change the first context or removed line of the patch's index-th hunk, as an upstream edit would."""
    lines = patch_path.read_text().splitlines(keepends=True)
    header = [i for i, line in enumerate(lines) if line.startswith("@@")][index]
    first = next(i for i in range(header + 1, len(lines)) if lines[i][:1] in (" ", "-"))
    lines[first] = lines[first].rstrip("\n") + "  # changed upstream\n"
    patch_path.write_text("".join(lines))


@pytest.mark.parametrize("name, path, line, index", hunks_with_upstream_lines())
def test_each_mutated_hunk_is_drift_at_its_file_and_line(tree, lock, release, cli, name, path, line, index):
    mutate_hunk(release.series_dir / name, index)
    before = snapshot(tree.root)

    inspection = operations.verify(sglang_dir=tree.root, lock=lock)
    assert inspection.state.kind == "drift"
    drifted = [(r.patch, r.path, r.line) for r in inspection.state.reports if r.status == DRIFT]
    assert drifted == [(name, path, line)]

    code, out, _ = cli("verify", "--dir", tree.root)
    assert code == 1
    assert re.search(rf"^{re.escape(name)}\s+{re.escape(path)}:{line}\s+drift$", out, re.MULTILINE)
    assert "state: drift" in out

    with pytest.raises(ToolError, match="drifted") as refused:
        operations.apply(sglang_dir=tree.root, lock=lock)
    assert refused.value.exit_code == 1
    assert cli("apply", "--dir", tree.root)[0] == 1
    assert snapshot(tree.root) == before


def test_a_file_the_series_would_create_that_already_exists_is_drift(tree, lock):
    (tree.package_root / DUMP_MODULE).write_text("# someone else's module\n")
    before = snapshot(tree.root)

    state = operations.verify(sglang_dir=tree.root, lock=lock).state
    assert state.kind == "drift"
    assert [(r.path, r.line) for r in state.reports if r.status == DRIFT] == [(DUMP_MODULE, 1)]
    with pytest.raises(ToolError):
        operations.apply(sglang_dir=tree.root, lock=lock)
    assert snapshot(tree.root) == before


def test_hunks_are_found_a_few_lines_away_but_not_beyond_max_offset(package_tree, lock):
    model = package_tree.package_root / MODEL
    upstream = model.read_text()
    model.write_text("# one\n# two\n# three\n" + upstream)
    reports = operations.verify(sglang_dir=package_tree.root, lock=lock).state.reports
    model_reports = [(r.line, r.status, r.offset) for r in reports if r.path == MODEL]
    assert model_reports == [(10, APPLIES, 3), (65, APPLIES, 3), (80, APPLIES, 3)]

    model.write_text("#\n" * (MAX_OFFSET + 1) + upstream)
    state = operations.verify(sglang_dir=package_tree.root, lock=lock).state
    assert state.kind == "drift"
    assert [(r.line, r.status) for r in state.reports if r.patch == PATCH_NAMES[1]] == [(7, DRIFT), (62, DRIFT)]


def test_a_file_without_final_newline_applies_and_reverts_exactly(tmp_path, package_tree):
    """git marks such a line with "\\ No newline at end of file"; the hunk must still match it."""
    model = package_tree.package_root / MODEL
    model.write_bytes(model.read_bytes().rstrip(b"\n"))
    upstream = model.read_bytes()
    repo = git.Repo.init(package_tree.root)
    repo.git.add("--all")
    repo.git.commit("--quiet", "-m", "upstream")
    model.write_bytes(upstream.replace(b"EntryClass = [DeepseekV2ForCausalLM]",
                                       b"EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]"))
    patched = model.read_bytes()
    diff = repo.git.diff("--no-color", "-U3") + "\n"
    assert "\\ No newline at end of file" in diff
    repo.git.checkout("--", MODEL)
    shutil.rmtree(package_tree.root / ".git")

    series_dir = tmp_path / "elsewhere" / "patches" / f"v{VERSION}"
    series_dir.mkdir(parents=True)
    (series_dir / "series").write_text("0001-register-v3.patch\n")
    (series_dir / "0001-register-v3.patch").write_text(
        "Description: Register DeepseekV3\nAuthor: tests\nForwarded: no\nLast-Update: 2025-06-05\n---\n" + diff
    )
    lock_path = tmp_path / "elsewhere" / "sglang.lock"
    lock_path.write_text(lock_toml(VERSION, {VERSION: {MODEL: sha256_of(model)}}, "0" * 64))
    lock = load_lock(lock_path)

    assert operations.verify(sglang_dir=package_tree.root, lock=lock).state.kind == "clean"
    operations.apply(sglang_dir=package_tree.root, lock=lock)
    assert model.read_bytes() == patched
    assert operations.verify(sglang_dir=package_tree.root, lock=lock).state.kind == "applied"
    operations.revert(sglang_dir=package_tree.root, lock=lock)
    assert model.read_bytes() == upstream
