"""README.md's per-release patch tables, generated from each release's series and the first line
of each patch's DEP-3 Description, between marker comments that only this module writes into."""

import re
from pathlib import Path

from scripts.toolchain.errors import ToolError
from scripts.toolchain.lock import Lock, Release
from scripts.toolchain.series import header_fields, load_series

README_NAME = "README.md"  # next to the lock file
COMMAND = "make readme-tables"
MARKER = re.compile(r"<!-- patch-table v(?P<version>\S+) (?:begin|end) -->")


def begin_marker(version: str) -> str:
    return f"<!-- patch-table v{version} begin -->"


def end_marker(version: str) -> str:
    return f"<!-- patch-table v{version} end -->"


def patch_table(release: Release) -> str:
    """One row per patch, in series order: its number (a link to the patch) and its summary."""
    rows = [f"| patch ({release.version}) | what |", "|---|---|"]
    for patch in load_series(release.series_dir):
        number = patch.name.split("-", 1)[0]
        summary = header_fields(patch.header)["Description"].replace("|", "\\|")
        rows.append(f"| [{number}](patches/v{release.version}/{patch.name}) | {summary} |")
    return "\n".join(rows) + "\n"


def render(text: str, lock: Lock) -> str:
    """`text` with the table between each locked release's markers generated anew."""
    unlocked = sorted({m["version"] for m in MARKER.finditer(text)} - set(lock.releases))
    if unlocked:
        raise ToolError(f"{README_NAME} has patch tables for {', '.join(unlocked)}, which sglang.lock does not "
                        f"pin: remove them (markers included), then run {COMMAND}.")
    for version, release in lock.releases.items():
        begin, end = begin_marker(version), end_marker(version)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise ToolError(f"{README_NAME} needs the lines `{begin}` and `{end}`, once each and in that order, "
                            f"where the table of sglang {version}'s patches goes; then run {COMMAND}.")
        before, rest = text.split(begin)
        after = rest.split(end)[1]
        text = f"{before}{begin}\n{patch_table(release)}{end}{after}"
    return text


def update(readme: Path, lock: Lock) -> bool:
    """Rewrite the tables in `readme`; returns whether anything changed."""
    text = readme.read_text()
    new = render(text, lock)
    if new != text:
        readme.write_text(new)
    return new != text
