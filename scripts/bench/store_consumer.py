"""The trainers' side of a Mooncake sink contender in the benchmarks: follows one control
directory and takes every published sample out of the store, so that the store never fills.

    python -m scripts.bench.store_consumer CONTROL_DIR --mode ack|read [--workers N]

`ack`: each sample acknowledged as soon as its manifest line appears, never read:
HiddenStatesStream's ack (the durable ack log, then a forced remove of its objects). The
store then costs the server what its puts cost, with a consumer that costs next to nothing.
`read`: the trainer's loop of the README, every sample read by HiddenStatesStream through a
DataLoader of N workers, then acknowledged: what a trainer reading at the dump's rate on the
same machine adds.

The store's settings come from the MOONCAKE_* variables of the environment. The benchmark
counts the acknowledgements (stream.acknowledged_count) to know when a round is drained; the
consumer ends once the control directory holds the closed marker and every sample is
acknowledged.
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Tuple

from torch.utils.data import DataLoader

from scripts.dump_format import ManifestFollower
from scripts.online.stream import CLOSED_MARKER, HiddenStatesStream

MODES = ("ack", "read")
# How often an idle consumer looks for new manifest lines: a round's drain is waited for
# after its last line, so this bounds what the wait adds.
POLL_INTERVAL_S = 0.005


def acknowledge_unread(stream: HiddenStatesStream, control_dir: Path) -> Tuple[int, int]:
    """Acknowledge every sample as its line appears, until the closed marker; the samples and
    their bytes in the store."""
    follower = ManifestFollower(control_dir)
    samples = stored_bytes = 0
    while True:
        # Looked at before reading: every line was appended before the marker was made.
        closed = (control_dir / CLOSED_MARKER).exists()
        entries = follower.poll()
        if entries:
            stream.ack([entry["sample_id"] for entry in entries])
            samples += len(entries)
            stored_bytes += sum(entry["bytes"] for entry in entries)
        elif closed:
            return samples, stored_bytes
        else:
            time.sleep(POLL_INTERVAL_S)


def read_and_acknowledge(stream: HiddenStatesStream, workers: int) -> Tuple[int, int]:
    """Read every sample as a trainer does and acknowledge it; the samples and the bytes read."""
    samples = read_bytes = 0
    # Out of order: in order, the loader waits for the next sample of the worker whose turn it
    # is, and a worker whose samples are all taken holds every other worker's back until more
    # are published (a round's last samples would wait for the next round). The workers are
    # forked once, as the loop starts: before the first ack opens this process's store client.
    for sample in DataLoader(stream, batch_size=None, num_workers=workers, in_order=False):
        stream.ack([sample["sample_id"]])
        samples += 1
        read_bytes += sum(value.numel() * value.element_size() for name, value in sample.items()
                          if name != "sample_id")
    return samples, read_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("control_dir", type=Path)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--workers", type=int, default=2, help="read: the DataLoader's workers (the README's 2)")
    args = parser.parse_args(argv)
    stream = HiddenStatesStream(args.control_dir, fields="specforge", poll_interval_s=POLL_INTERVAL_S)
    started = time.monotonic()
    if args.mode == "ack":
        samples, size = acknowledge_unread(stream, args.control_dir)
    else:
        samples, size = read_and_acknowledge(stream, args.workers)
    print(f"{args.mode}: {samples} samples, {size} bytes, in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
