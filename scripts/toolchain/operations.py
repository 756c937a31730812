"""The four things a user does to a tree, each a short recipe: verify, apply, revert, refresh-patches."""

from typing import List

from scripts.toolchain import checkout, refresh
from scripts.toolchain.errors import ToolError
from scripts.toolchain.hunks import apply_chain, series_paths
from scripts.toolchain.inspection import Inspection, existing_checkout, half_applied_advice, inspect, stale_advice
from scripts.toolchain.lock import load_lock
from scripts.toolchain.overlay import OVERLAY_DIR, read_overlay, stale_in_tree


def verify(version=None, sglang_dir=None, lock=None) -> Inspection:
    return inspect(version, sglang_dir, lock, build_checkout=False)


def apply(version=None, sglang_dir=None, allow_unlocked=False, lock=None) -> str:
    inspection = inspect(version, sglang_dir, lock)
    state = inspection.state
    if state.kind == "applied":
        if inspection.stale:
            raise ToolError(stale_advice(inspection, inspection.stale))
        return f"the series for sglang {inspection.release.version} is already applied; nothing to do"
    if state.kind != "clean":
        raise ToolError(half_applied_advice(inspection))
    if not inspection.locked and not allow_unlocked:
        raise ToolError(unlocked_advice(inspection))
    files = inspection.tree.read(series_paths(inspection.patches))
    if inspection.pinned:
        checkout.commit_series(inspection.tree, files, inspection.patches)
    else:
        patched, _ = apply_chain(files, inspection.patches, reverse=False)
        inspection.tree.write(patched, files)
    # The series itself may be older than the overlay: what it just wrote must not run either.
    stale = stale_in_tree(inspection.tree, read_overlay(inspection.release.root / OVERLAY_DIR))
    if stale:
        raise ToolError(f"The series is applied, but patches/v{inspection.release.version}/ is older than "
                        f"{OVERLAY_DIR}/. " + stale_advice(inspection, stale))
    return f"applied {len(inspection.patches)} patches for sglang {inspection.release.version} to {inspection.tree.root}"


def unlocked_advice(inspection: Inspection) -> str:
    return (f"every hunk applies, but the tree's files differ from those sglang.lock pins for "
            f"sglang {inspection.release.version}, so the series was never tested on them. "
            f"Pass ALLOW_UNLOCKED=1 to apply anyway.")


def revert(version=None, sglang_dir=None, lock=None) -> str:
    inspection = inspect(version, sglang_dir, lock, build_checkout=False)
    state = inspection.state
    if state.kind == "clean":
        return f"no patch of the series is applied in {inspection.tree.root}; nothing to do"
    if inspection.pinned:
        # The checkout is this project's own git repository: its upstream commit restores the
        # upstream bytes whatever series its commits hold, unless edits are uncommitted.
        if checkout.has_uncommitted_changes(inspection.tree):
            raise ToolError(f"{inspection.tree.root} has uncommitted changes: commit or discard them first.")
        old_head = checkout.reset_to_upstream(inspection.tree)
        return f"reset {inspection.tree.root} to upstream (it was at {old_head[:12]})"
    if state.kind == "drift":
        raise ToolError(half_applied_advice(inspection))
    current = inspection.tree.read(list(state.upstream))
    inspection.tree.write(state.upstream, current)
    return f"reverted {state.applied_count} patches in {inspection.tree.root}"


def refresh_patches(version=None, lock=None) -> List[str]:
    lock = lock or load_lock()
    release = lock.release(version)
    return refresh.refresh(existing_checkout(release), release.series_dir, release.root / OVERLAY_DIR)
