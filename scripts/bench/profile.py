"""Summarize a py-spy profile of a dumping server (`py-spy record --format raw`: one line per
distinct stack, root first, frames joined by ';', then its sample count).

Stacks are sorted into the scheduler's event loop, the dump's writer threads and the rest;
for each, the on-CPU seconds and the functions that held the CPU (self time), and for the
event loop the share spent inside the dump module.

    python -m scripts.bench.profile PROFILE.txt [--rate HZ]
"""

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

DUMP_PACKAGE = "hidden_states_dump/"  # frames name their file, e.g. .../hidden_states_dump/writer.py
DUMP_WRITER = DUMP_PACKAGE + "writer.py"
LINE_NUMBER = re.compile(r":\d+\)$")


def read_stacks(path: Path) -> List[Tuple[List[str], int]]:
    """(frames, samples) of each stack; a process's frame is its command line, which may
    hold newlines (`python -c` of multiprocessing's spawn), so a stack ends at a line that
    ends in its count."""
    stacks, pending = [], ""
    for line in path.read_text(errors="replace").splitlines():
        pending += line if not pending else "\n" + line
        stack, _, count = pending.rpartition(" ")
        if stack and count.isdigit():
            stacks.append(([LINE_NUMBER.sub(")", frame) for frame in stack.split(";")], int(count)))
            pending = ""
    return stacks


def function_name(frame: str) -> str:
    """`Class.method (file.py)` -> `method`."""
    return frame.split(" (", 1)[0].rsplit(".", 1)[-1]


def kind_of(frames: List[str]) -> str:
    if any(function_name(frame) == "_run" and DUMP_WRITER in frame for frame in frames):
        return "dump writer threads"
    if any(function_name(frame).startswith("event_loop") for frame in frames):
        return "scheduler event loop"
    return "other (startup, tokenizer, detokenizer, HTTP)"


def summarize(stacks: List[Tuple[List[str], int]], rate: float, top: int = 12) -> Dict[str, dict]:
    by_kind: Dict[str, dict] = {}
    for frames, count in stacks:
        kind = by_kind.setdefault(kind_of(frames), {"samples": 0, "self": Counter(), "in_dump": 0})
        kind["samples"] += count
        kind["self"][frames[-1]] += count
        if any(DUMP_PACKAGE in frame for frame in frames):
            kind["in_dump"] += count
    summary = {}
    for name, kind in sorted(by_kind.items(), key=lambda item: -item[1]["samples"]):
        samples = kind["samples"]
        summary[name] = {
            "on_cpu_s": round(samples / rate, 2),
            "share_in_dump_module": round(kind["in_dump"] / samples, 3),
            "self_time_top": [{"function": function, "share": round(count / samples, 3)}
                              for function, count in kind["self"].most_common(top)],
        }
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's sampling rate (--rate), per second")
    args = parser.parse_args(argv)
    print(json.dumps(summarize(read_stacks(args.profile), args.rate), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
