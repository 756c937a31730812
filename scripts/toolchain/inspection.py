"""Where a tree stands against a series: every hunk applies, is applied, or has drifted, and whether
the files the series adds still equal their one source in sglang_overlay/. Writes nothing."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from scripts.toolchain import checkout
from scripts.toolchain.errors import USAGE, ToolError
from scripts.toolchain.hunks import TreeState, classify, series_paths
from scripts.toolchain.lock import Lock, Release, load_lock, sha256_bytes
from scripts.toolchain.overlay import OVERLAY_DIR, read_overlay, stale_in_tree
from scripts.toolchain.series import Patch, load_series
from scripts.toolchain.tree import Tree, locate


@dataclass
class Inspection:
    release: Release
    tree: Tree
    patches: List[Patch]
    state: TreeState
    matching_release: Optional[Release]  # the locked release the tree's upstream files equal
    # Overlay files an applied tree lacks or holds with other bytes (package-root paths).
    stale: List[str] = field(default_factory=list)

    @property
    def locked(self) -> bool:
        """The tree's upstream files are the ones sglang.lock pins for this release."""
        return self.matching_release is self.release

    @property
    def pinned(self) -> bool:
        return checkout.is_pinned(self.tree, self.release)


def inspect(version: Optional[str] = None, sglang_dir: Optional[Path] = None, lock: Optional[Lock] = None,
            build_checkout: bool = True) -> Inspection:
    """Load the lock, open the tree, and find where every hunk of the series stands. Writes nothing
    (except building the pinned checkout when no tree is named and build_checkout is set)."""
    lock = lock or load_lock()
    if sglang_dir is None:
        release = lock.release(version)
        tree = checkout.ensure(release) if build_checkout else existing_checkout(release)
        return _inspect_with(lock, release, tree)
    tree = locate(sglang_dir)
    if version is not None:
        return _inspect_with(lock, lock.release(version), tree)
    candidates = [lock.release(None)] + [r for v, r in lock.releases.items() if v != lock.default]
    inspections = [_inspect_with(lock, release, tree) for release in candidates]
    for inspection in inspections:
        if inspection.matching_release is inspection.release:
            return inspection
    return inspections[0]


def existing_checkout(release: Release) -> Tree:
    if not (release.checkout_dir / ".git").exists():
        raise ToolError(f"{release.checkout_dir} does not exist yet: run make apply first.", USAGE)
    return checkout.ensure(release)


def _inspect_with(lock: Lock, release: Release, tree: Tree) -> Inspection:
    patches = load_series(release.series_dir)
    files = tree.read(sorted(set(series_paths(patches)) | set(release.files)))
    state = classify(files, patches)
    matching = None
    if state.upstream is not None:
        hashes = {
            path: sha256_bytes("".join(lines).encode("utf-8")) if lines is not None else None
            for path, lines in state.upstream.items()
        }
        matching = lock.matching_release(hashes)
    stale = stale_in_tree(tree, read_overlay(release.root / OVERLAY_DIR)) if state.kind == "applied" else []
    return Inspection(release, tree, patches, state, matching, stale)


def half_applied_advice(inspection: Inspection) -> str:
    state = inspection.state
    if state.kind == "partial":
        names = ", ".join(p.name for p in inspection.patches[: state.applied_count])
        return (f"The tree is half-applied: {names} are in, the rest of the series is not. "
                f"Run `make revert` to take them out, then `make apply`.")
    if inspection.pinned:
        return (f"The pinned checkout {inspection.tree.root} differs from "
                f"patches/v{inspection.release.version}: it holds another version of the series "
                "(an older one, or commits not refreshed yet) or uncommitted edits. If its "
                "commits are what you want, run `make refresh-patches`; if patches/ is, run "
                "`make revert` (it resets the checkout to upstream; the old commits stay in its "
                "reflog), then `make apply`.")
    return ("The tree has drifted: some hunks match neither the upstream nor the patched lines "
            "(hand edits, another release, or another patch set). Restore the upstream files "
            "(reinstall the release, or `git checkout` them in a clone), then run `make apply`.")


def stale_advice(inspection: Inspection, stale: List[str]) -> str:
    version = inspection.release.version
    refresh = f"make refresh-patches SGLANG_VERSION={version}"
    text = (f"{inspection.tree.package_root} is stale: it does not hold {', '.join(stale)} as "
            f"{OVERLAY_DIR}/, their one source, has them, so SGLang would run an old copy. ")
    if inspection.pinned:
        return text + (f"Run `{refresh}`: it amends the checkout's commits to the overlay's bytes and "
                       f"regenerates patches/v{version}/ from them.")
    tree_args = f"SGLANG_VERSION={version} SGLANG_DIR={inspection.tree.root}"
    return text + (f"Take the series out with `make revert {tree_args}`, bring patches/v{version}/ up to "
                   f"the overlay with `{refresh}`, then run `make apply {tree_args}`.")
