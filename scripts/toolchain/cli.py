"""Command line: python -m scripts.toolchain {verify,apply,revert,refresh-patches} [--version V] [--dir D] [--lock L]
                python -m scripts.toolchain readme-tables [--lock L]
                python -m scripts.toolchain port --from V --to W [--python X.Y]
                python -m scripts.toolchain {port-continue,port-skip,port-abort} [--to W]

Exit codes: 0 clean or done, 1 drift / half-applied / stale / refused, 2 usage error.
"""

import argparse
import sys
from pathlib import Path

from scripts.toolchain import operations, port, readme
from scripts.toolchain.errors import USAGE, ToolError
from scripts.toolchain.hunks import DRIFT
from scripts.toolchain.inspection import Inspection, half_applied_advice, stale_advice
from scripts.toolchain.lock import LOCK_PATH, load_lock


def format_inspection(inspection: Inspection, allow_unlocked: bool = False) -> str:
    state = inspection.state
    tree = inspection.tree
    out = [f"sglang {inspection.release.version} series ({len(inspection.patches)} patches) "
           f"against {tree.root} ({tree.layout} layout)"]
    if inspection.matching_release is not None:
        out.append(f"upstream files match the locked release {inspection.matching_release.version}")
    else:
        out.append("upstream files match no release in sglang.lock")
    rows = [(r.patch, f"{r.path}:{r.line}", r.status + (f" (offset {r.offset:+d})" if r.offset else ""), r)
            for r in state.reports]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(("patch", "file:line", "status"))]
    out.append(f"{'patch':<{widths[0]}}  {'file:line':<{widths[1]}}  status")
    for patch, where, status, report in rows:
        out.append(f"{patch:<{widths[0]}}  {where:<{widths[1]}}  {status}")
        if report.status == DRIFT:
            out += ["      expected: " + repr(line) for line in report.expected[:6]]
            out += ["      found:    " + repr(line) for line in report.found[:6]]
    summary = {
        "clean": "clean: the whole series applies",
        "applied": "applied: every patch of the series is in" + (", but the tree is stale" if inspection.stale else ""),
        "partial": f"half-applied: {state.applied_count} of {len(inspection.patches)} patches are in",
        "drift": "drift: the series cannot be applied to this tree",
    }[state.kind]
    out += [f"stale: {path}" for path in inspection.stale]
    out.append(f"state: {summary}")
    if inspection.stale:
        out.append(stale_advice(inspection, inspection.stale))
    elif state.kind in ("partial", "drift"):
        out.append(half_applied_advice(inspection))
    elif state.kind == "clean" and not inspection.locked:
        out.append(("warning: " if allow_unlocked else "unlocked: ") + operations.unlocked_advice(inspection))
    return "\n".join(out)


def verified(inspection: Inspection, allow_unlocked: bool) -> bool:
    """What verify's exit status says: apply would go through (or has), as make apply runs it."""
    if inspection.state.kind == "applied":
        return not inspection.stale
    return inspection.state.kind == "clean" and (inspection.locked or allow_unlocked)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.toolchain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["verify", "apply", "revert", "refresh-patches", "readme-tables",
                                            "port", "port-continue", "port-skip", "port-abort"])
    parser.add_argument("--version", default=None, help="an SGLang release in sglang.lock (default: its default)")
    parser.add_argument("--dir", default=None, type=Path,
                        help="patch this tree (a git clone or a package root) instead of the pinned checkout")
    parser.add_argument("--allow-unlocked", action="store_true",
                        help="apply even when the tree's files differ from the locked release")
    parser.add_argument("--lock", default=LOCK_PATH, type=Path,
                        help="the lock file (default: sglang.lock); patches/ and .sglang/ lie next to it")
    parser.add_argument("--from", dest="from_version", default=None,
                        help="port: the locked release whose series is carried")
    parser.add_argument("--to", dest="to_version", default=None,
                        help="port: the new release (port-continue/-skip/-abort: the port in progress)")
    parser.add_argument("--python", default=None,
                        help=f"port: the CPython the new release runs on, which picks its wheel (default {port.DEFAULT_PYTHON})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return USAGE if e.code else 0
    version = args.version or None
    try:
        lock = load_lock(args.lock)
        if args.command == "verify":
            inspection = operations.verify(version, args.dir, lock)
            print(format_inspection(inspection, args.allow_unlocked))
            return 0 if verified(inspection, args.allow_unlocked) else 1
        if args.command == "port":
            print(port.start(args.from_version, args.to_version, args.python, args.lock))
        elif args.command in ("port-continue", "port-skip"):
            print(port.resume(args.command.split("-", 1)[1], args.to_version or None, args.lock))
        elif args.command == "port-abort":
            print(port.abort(args.to_version or None, args.lock))
        elif args.command == "apply":
            print(operations.apply(version, args.dir, args.allow_unlocked, lock))
        elif args.command == "revert":
            print(operations.revert(version, args.dir, lock))
        elif args.command == "readme-tables":
            path = args.lock.resolve().parent / readme.README_NAME
            changed = readme.update(path, lock)
            print(f"rewrote the patch tables in {path}" if changed else f"the patch tables in {path} are up to date")
        else:
            names = operations.refresh_patches(version, lock)
            print(f"wrote {len(names)} patches and the series file")
        return 0
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
