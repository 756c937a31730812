"""Hunk verification: where each hunk of a series stands against a tree, before anything is written.

A tree is held in memory as {path: lines or None} (None: the file does not exist). Every
hunk is compared line for line with the file at the position its header gives; a hunk may
also match up to MAX_OFFSET lines away (an upstream file with a few lines added above it).
Content is never matched fuzzily.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from unidiff.constants import LINE_TYPE_ADDED, LINE_TYPE_CONTEXT, LINE_TYPE_NO_NEWLINE, LINE_TYPE_REMOVED

from scripts.toolchain.series import Patch

MAX_OFFSET = 20

APPLIES = "applies"  # upstream lines found: the hunk can be applied
APPLIED = "applied"  # patched lines found: the hunk is already in
DRIFT = "drift"  # neither: the file differs from what the series was made against

Files = Dict[str, Optional[List[str]]]


@dataclass
class HunkReport:
    patch: str
    path: str
    line: int  # 1-based line in the file where the hunk was (or was expected to be) found
    status: str
    offset: int = 0
    expected: List[str] = field(default_factory=list)
    found: List[str] = field(default_factory=list)


@dataclass
class TreeState:
    """How the tree relates to the series: patches[:applied_count] are in, the rest are not.

    kind is "clean" (none in), "applied" (all in), "partial" (a prefix in) or "drift".
    upstream holds the files with every applied patch taken out (None on drift).
    """

    kind: str
    applied_count: int
    upstream: Optional[Files]
    reports: List[HunkReport]


def _hunk_anchor(start: int, length: int) -> int:
    # A hunk with no lines on one side ("-0,0" or "+12,0") is anchored after line `start`.
    return start if length == 0 else start - 1


def _find(lines: List[str], expected: List[str], anchor: int) -> Optional[int]:
    for distance in range(MAX_OFFSET + 1):
        for offset in (distance, -distance) if distance else (0,):
            pos = anchor + offset
            if 0 <= pos and pos + len(expected) <= len(lines):
                if lines[pos : pos + len(expected)] == expected:
                    return offset
    return None


def _side_lines(hunk, kept_types) -> List[str]:
    # unidiff keeps the "\n" of a line that "\ No newline at end of file" follows; the file has none.
    lines = list(hunk)
    side = []
    for line, following in zip(lines, lines[1:] + [None]):
        if line.line_type in kept_types:
            ends_without_newline = following is not None and following.line_type == LINE_TYPE_NO_NEWLINE
            side.append(line.value.removesuffix("\n") if ends_without_newline else line.value)
    return side


def _source_lines(hunk) -> List[str]:
    return _side_lines(hunk, (LINE_TYPE_CONTEXT, LINE_TYPE_REMOVED))


def _target_lines(hunk) -> List[str]:
    return _side_lines(hunk, (LINE_TYPE_CONTEXT, LINE_TYPE_ADDED))


def _sides(hunk, reverse: bool):
    source = _source_lines(hunk)
    target = _target_lines(hunk)
    source_anchor = _hunk_anchor(hunk.source_start, hunk.source_length)
    target_anchor = _hunk_anchor(hunk.target_start, hunk.target_length)
    if reverse:
        return target, target_anchor, source, source_anchor
    return source, source_anchor, target, target_anchor


def transform(files: Files, patch: Patch, reverse: bool = False) -> Tuple[bool, Files, List[HunkReport]]:
    """Apply (or with reverse, take out) one patch in memory.

    Returns (ok, new files, one report per hunk). ok is False when any hunk does not match;
    the new files are then meaningless.
    """
    ok_status = APPLIED if reverse else APPLIES
    new_files = dict(files)
    reports: List[HunkReport] = []
    ok = True
    for patched_file in patch.patchset:
        path = patched_file.path
        lines = files.get(path)
        deletes = patched_file.is_added_file and reverse
        if patched_file.is_added_file:
            whole = [line for hunk in patched_file for line in _target_lines(hunk)]
            if deletes:
                matches = lines == whole
                reports.append(
                    HunkReport(patch.name, path, 1, ok_status if matches else DRIFT,
                               expected=whole[:3], found=(lines or [])[:3])
                )
                ok &= matches
                new_files[path] = None
            else:
                matches = lines is None
                reports.append(
                    HunkReport(patch.name, path, 1, ok_status if matches else DRIFT,
                               expected=["(file absent)"], found=(lines or [])[:3])
                )
                ok &= matches
                new_files[path] = whole
            continue
        if lines is None:
            reports.append(HunkReport(patch.name, path, 1, DRIFT, expected=["(file present)"],
                                      found=["(file absent)"]))
            ok = False
            continue
        placements = []
        for hunk in patched_file:
            expected, anchor, replacement, _ = _sides(hunk, reverse)
            offset = _find(lines, expected, anchor)
            if offset is None:
                reports.append(HunkReport(patch.name, path, anchor + 1, DRIFT, expected=expected,
                                          found=lines[anchor : anchor + len(expected)]))
                ok = False
            else:
                reports.append(HunkReport(patch.name, path, anchor + offset + 1, ok_status, offset))
                placements.append((anchor + offset, len(expected), replacement))
        new_lines = list(lines)
        for pos, length, replacement in sorted(placements, reverse=True):
            new_lines[pos : pos + length] = replacement
        new_files[path] = new_lines
    return ok, new_files, reports


def apply_chain(files: Files, patches: List[Patch], reverse: bool):
    """(files after the whole chain or None if a hunk did not match, reports in chain order)."""
    reports: List[HunkReport] = []
    for patch in patches:
        ok, files, patch_reports = transform(files, patch, reverse)
        reports += patch_reports
        if not ok:
            return None, reports
    return files, reports


def describe_hunks(files: Files, patches: List[Patch]) -> List[HunkReport]:
    """One report per hunk, each as applies, applied or drift, walking the series in order."""
    reports = []
    for patch in patches:
        ok, forward, forward_reports = transform(files, patch)
        if ok:
            reports += forward_reports
            files = forward
            continue
        _, _, reverse_reports = transform(files, patch, reverse=True)
        for ahead, back in zip(forward_reports, reverse_reports):
            reports.append(ahead if ahead.status == APPLIES else back if back.status == APPLIED else ahead)
    return reports


def classify(files: Files, patches: List[Patch]) -> TreeState:
    """Find k such that the tree is upstream with exactly patches[:k] applied."""
    n = len(patches)
    for k in range(n, -1, -1):
        upstream, applied_reports = apply_chain(files, list(reversed(patches[:k])), reverse=True)
        if upstream is None:
            continue
        patched, pending_reports = apply_chain(files, patches[k:], reverse=False)
        if patched is None:
            continue
        kind = "applied" if k == n else "clean" if k == 0 else "partial"
        reports = _in_series_order(applied_reports + pending_reports, patches)
        return TreeState(kind, k, upstream, reports)
    return TreeState("drift", 0, None, describe_hunks(files, patches))


def _in_series_order(reports: List[HunkReport], patches: List[Patch]) -> List[HunkReport]:
    rank = {patch.name: i for i, patch in enumerate(patches)}
    return sorted(reports, key=lambda r: rank[r.patch])  # stable: hunk order is kept


def series_paths(patches: List[Patch]) -> List[str]:
    paths: List[str] = []
    for patch in patches:
        for path in patch.paths:
            if path not in paths:
                paths.append(path)
    return paths
