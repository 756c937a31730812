"""The progress bar and the byte counts every long-running dump tool shows: `generate` while it
dumps, the exports and `inspect_dump` while they read (and write) every file of a dump."""

import sys
import time
from dataclasses import dataclass, field
from typing import Optional


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:,.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1000


def progress_bar(total: int, initial: int = 0, desc: Optional[str] = None):
    """A bar over `total` samples on stderr (tqdm: count, rate, ETA); the caller adds its own
    figures with set_postfix_str."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="sample", dynamic_ncols=True, mininterval=0.5, file=sys.stderr,
                desc=desc)


@dataclass
class ByteTally:
    """Samples and bytes a tool read and wrote since it started, for its bar and its summary."""

    samples: int = 0
    skipped: int = 0  # samples an earlier run did
    bytes_read: int = 0
    bytes_written: int = 0
    started: float = field(default_factory=time.monotonic)
    ended: Optional[float] = None

    def finish(self) -> None:
        """Stop the clock (the summary's seconds end here)."""
        self.ended = time.monotonic()

    def add(self, bytes_read: int, bytes_written: int = 0) -> None:
        self.samples += 1
        self.bytes_read += bytes_read
        self.bytes_written += bytes_written

    @property
    def seconds(self) -> float:
        return max((self.ended or time.monotonic()) - self.started, 1e-9)

    @property
    def bytes_per_s(self) -> float:
        return (self.bytes_read + self.bytes_written) / self.seconds

    def postfix(self) -> str:
        written = f", wrote {human_bytes(self.bytes_written)}" if self.bytes_written else ""
        return f"read {human_bytes(self.bytes_read)}{written}, {human_bytes(self.bytes_per_s)}/s"

    def summary(self, verb: str, noun: str = "samples") -> str:
        written = f", wrote {human_bytes(self.bytes_written)} ({self.bytes_written:,} bytes)" if self.bytes_written else ""
        earlier = f" ({self.skipped} more done by an earlier run)" if self.skipped else ""
        return (f"{verb} {self.samples} {noun}{earlier} in {self.seconds:.1f} s: read {human_bytes(self.bytes_read)} "
                f"({self.bytes_read:,} bytes){written}, {(self.bytes_read + self.bytes_written) / self.seconds / 1e9:.2f} GB/s")
