"""A patch series: the `series` file, each patch's DEP-3 header, and its parsed hunks."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from unidiff import PatchSet, UnidiffParseError

from scripts.toolchain.errors import USAGE, ToolError

DIFF_START = re.compile(r"^(diff --git |--- )", re.MULTILINE)
HUNK_HEADER = re.compile(r"^@@", re.MULTILINE)  # in a diff, only hunk headers start with "@@"
REQUIRED_HEADER_FIELDS = ("Description", "Forwarded", "Last-Update")
# DEP-3 asks for at least one of these: who wrote the patch, or where it comes from.
PROVENANCE_FIELDS = ("Origin", "Author")
# Every release's patches: NNNN-<concern>.patch, numbered 0001, 0002, ... in series order.
PATCH_NAME = re.compile(r"(?P<number>\d{4})-(?P<concern>[a-z0-9]+(?:-[a-z0-9]+)*)\.patch")
NAMING_RULE = ("a patch is named NNNN-<concern>.patch (lowercase words joined by hyphens), numbered "
               "0001, 0002, ... in series order with no gaps")


@dataclass
class Patch:
    name: str  # file name, e.g. "0001-capture-aux-hidden-states.patch"
    header: str  # the DEP-3 header: every line before the diff
    patchset: PatchSet

    @property
    def stem(self) -> str:
        return self.name[: -len(".patch")] if self.name.endswith(".patch") else self.name

    @property
    def paths(self) -> List[str]:
        return [patched_file.path for patched_file in self.patchset]


def split_header(text: str):
    """(DEP-3 header, diff) of a patch file's text; the header ends at its `---` line."""
    match = DIFF_START.search(text)
    if match is None:
        return text, ""
    header = text[: match.start()]
    if header.endswith("---\n"):
        header = header[: -len("---\n")]
    return header.rstrip("\n") + "\n", text[match.start() :]


def header_fields(header: str) -> dict:
    fields = {}
    for line in header.splitlines():
        if line[:1].isspace() or ":" not in line:
            continue
        key, value = line.split(":", 1)
        fields[key.strip()] = value.strip()
    return fields


def missing_header_fields(header: str) -> List[str]:
    """The DEP-3 fields a patch header lacks ("Origin or Author" counts as one)."""
    present = header_fields(header)
    missing = [f for f in REQUIRED_HEADER_FIELDS if f not in present]
    if not any(f in present for f in PROVENANCE_FIELDS):
        missing.append(" or ".join(PROVENANCE_FIELDS))
    return missing


def misnamed(names: List[str]) -> List[str]:
    """The names, in series order, that break NAMING_RULE at their position."""
    return [name for position, name in enumerate(names, 1) if numbered(name, position) != name]


def numbered(name: str, position: int) -> Optional[str]:
    """The name a patch at `position` (1-based) carries under NAMING_RULE; None when no number fixes it."""
    match = PATCH_NAME.fullmatch(name)
    return f"{position:04d}-{match['concern']}.patch" if match else None


def read_series_names(series_dir: Path) -> List[str]:
    series_file = series_dir / "series"
    if not series_file.is_file():
        raise ToolError(f"{series_file} is missing: no patch series for this release.", USAGE)
    names = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def parse_patch(path: Path) -> Patch:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ToolError(f"{path} is listed in series but does not exist.", USAGE)
    header, diff = split_header(text)
    missing = missing_header_fields(header)
    if missing:
        raise ToolError(f"{path}: the DEP-3 header lacks {', '.join(missing)}.", USAGE)
    try:
        patchset = PatchSet(diff)
    except UnidiffParseError as e:
        raise ToolError(f"{path}: cannot parse the diff: {e}", USAGE)
    if not diff or len(patchset) == 0:
        raise ToolError(f"{path}: holds no diff.", USAGE)
    # unidiff skips a line it cannot read as a hunk header, and the hunk with it.
    if sum(len(patched_file) for patched_file in patchset) != len(HUNK_HEADER.findall(diff)):
        raise ToolError(f"{path}: a hunk header is not of the form `@@ -start,count +start,count @@`.", USAGE)
    for patched_file in patchset:
        if patched_file.is_removed_file or patched_file.is_rename:
            raise ToolError(
                f"{path}: {patched_file.path}: removing or renaming files is not supported.",
                USAGE,
            )
        if len(patched_file) == 0 and not patched_file.is_added_file:
            raise ToolError(
                f"{path}: {patched_file.path}: no hunk to apply (binary and mode-only changes are not supported).",
                USAGE,
            )
        for hunk in patched_file:
            if not hunk.is_valid():
                raise ToolError(
                    f"{path}: {patched_file.path}: hunk {hunk.source_start},"
                    f"{hunk.source_length} does not match its header counts.",
                    USAGE,
                )
    return Patch(name=path.name, header=header, patchset=patchset)


def load_series(series_dir: Path) -> List[Patch]:
    return [parse_patch(series_dir / name) for name in read_series_names(series_dir)]
