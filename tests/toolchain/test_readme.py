"""README.md's patch tables: generated from each release's series, and checked against it."""

import pytest

from scripts.paths import REPO_ROOT
from scripts.toolchain.readme import begin_marker, end_marker, render

from .helpers import PATCH_NAMES, REAL_LOCK, VERSION


def test_the_readme_tables_are_what_readme_tables_generates():
    readme = (REPO_ROOT / "README.md").read_text()
    assert render(readme, REAL_LOCK) == readme, (
        "README.md's patch tables differ from patches/: run make readme-tables")


def write_readme(project, table: str) -> str:
    text = f"# Project\n\nBefore.\n\n{table}\nAfter.\n"
    (project / "README.md").write_text(text)
    return text


def test_readme_tables_writes_each_table_between_its_markers_and_nothing_else(project, cli):
    stale = f"{begin_marker(VERSION)}\n| patch | what |\n| 0009 | hand-typed |\n{end_marker(VERSION)}\n"
    write_readme(project, stale)

    assert cli("readme-tables") == (0, f"rewrote the patch tables in {project / 'README.md'}\n", "")
    assert (project / "README.md").read_text() == write_readme(project, (
        f"{begin_marker(VERSION)}\n"
        f"| patch ({VERSION}) | what |\n"
        "|---|---|\n"
        f"| [0001](patches/v{VERSION}/{PATCH_NAMES[0]}) | Add the module that owns the EAGLE-3 hidden-state dump |\n"
        f"| [0002](patches/v{VERSION}/{PATCH_NAMES[1]}) | Capture aux hidden states in DeepseekV2 when dumping is on |\n"
        f"| [0003](patches/v{VERSION}/{PATCH_NAMES[2]}) | Hand the aux hidden states to the dump from the logits processor |\n"
        f"{end_marker(VERSION)}\n"))
    generated = (project / "README.md").read_bytes()
    assert cli("readme-tables")[1] == f"the patch tables in {project / 'README.md'} are up to date\n"
    assert (project / "README.md").read_bytes() == generated


@pytest.mark.parametrize("table, message", [
    ("| patch | what |\n", f"needs the lines `{begin_marker(VERSION)}` and `{end_marker(VERSION)}`"),
    (f"{end_marker(VERSION)}\n{begin_marker(VERSION)}\n", "once each and in that order"),
    (f"{begin_marker(VERSION)}\n{end_marker(VERSION)}\n{begin_marker('0.0.1')}\n{end_marker('0.0.1')}\n",
     "has patch tables for 0.0.1, which sglang.lock does not pin"),
])
def test_missing_or_unlocked_markers_are_refused_and_nothing_is_written(project, cli, table, message):
    before = write_readme(project, table)
    code, out, err = cli("readme-tables")
    assert (code, out) == (1, "")
    assert message in err and "make readme-tables" in err
    assert (project / "README.md").read_text() == before
