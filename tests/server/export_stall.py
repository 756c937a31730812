"""An export that stalls where a test will SIGKILL it, so the kill lands at a known point:

    python -m tests.server.export_stall GATE WHERE EXPORT ARGS...

EXPORT is export_specforge or export_speculators, run with ARGS. WHERE is `samples:N` (every
sample file after the first N stalls before its rename, its complete temporary file on disk)
or a file name (the export stalls before renaming that file into place). A stalled thread
first creates `<GATE>.holding`, then waits while GATE exists.
"""

import importlib
import sys
import threading
import time
from pathlib import Path

from scripts.dumps import exporting

SAMPLE_SUFFIXES = (".ckpt", ".ckpt.gz", ".safetensors")


def stall_publish(gate: Path, where: str) -> None:
    publish = exporting.publish
    lock = threading.Lock()
    published = [0]

    def stalls(path: Path) -> bool:
        if not where.startswith("samples:"):
            return path.name == where
        if not path.name.endswith(SAMPLE_SUFFIXES):
            return False
        with lock:
            published[0] += 1
            return published[0] > int(where.split(":", 1)[1])

    def stalled_publish(temp: Path, path: Path) -> None:
        if stalls(path):
            gate.with_name(gate.name + ".holding").touch()
            while gate.exists():
                time.sleep(0.01)
        publish(temp, path)

    exporting.publish = stalled_publish


def main(argv) -> int:
    gate, where, export, *args = argv
    stall_publish(Path(gate), where)
    return importlib.import_module(f"scripts.dumps.{export}").main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
