"""Measuring helpers the benchmarks share: workloads, sending them, waiting for their files
to land, the disk's own rates (dd writing, dd reading past the page cache), and summaries of
repeated measurements."""

import os
import random
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scripts.dump_format import ManifestFollower
from scripts.dumps.server import Server, wait_for_entries


def prompts_for(count: int, length: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(count)]


def send_all(server: Server, prompts, rids: Optional[List[str]] = None, **extra) -> float:
    """Seconds to prefill every prompt (one output token each), all sent at once; `rids`,
    when given, names each prompt's request."""
    started = time.perf_counter()
    named = [dict(rid=rid) for rid in rids] if rids is not None else [{}] * len(prompts)
    with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
        list(pool.map(lambda p, name: server.generate(p, max_new_tokens=1, **name, **extra), prompts, named))
    return time.perf_counter() - started


def wait_for_lines(follower: ManifestFollower, target: int, started: float, timeout: float) -> None:
    """Wait until the follower has seen `target` manifest entries."""
    left = timeout - (time.perf_counter() - started)
    entries = wait_for_entries(follower, lambda entries: len(entries) >= target, left, interval=0.002)
    if len(entries) < target:
        raise RuntimeError(f"{follower.dump_dir}: {len(entries)} of {target} manifest lines after {timeout}s")


def send_and_land(server: Server, prompts, dump_dir: Optional[Path] = None, timeout: float = 600) -> float:
    """Seconds to prefill every prompt (all sent at once) and, for a dumping server, until
    the manifest names a file for each: the writer's backlog is part of the cost."""
    return send_and_land_split(server, prompts, dump_dir, timeout)[1]


def send_and_land_split(server: Server, prompts, dump_dir: Optional[Path] = None,
                        timeout: float = 600) -> Tuple[float, float]:
    """send_and_land's seconds to the last response and to the last file landed."""
    follower = ManifestFollower(str(dump_dir)) if dump_dir else None
    target = len(follower.poll()) + len(prompts) if dump_dir else 0
    started = time.perf_counter()
    send_all(server, prompts)
    responded = time.perf_counter() - started
    if dump_dir:
        wait_for_lines(follower, target, started, timeout)
    return responded, time.perf_counter() - started


def clear_files(dump_dir: Optional[Path]) -> None:
    """Remove the dumped files (the manifest stays, for counting), so a long run neither
    fills the disk nor measures a disk whose cache is full of earlier rounds."""
    for path in dump_dir.glob("*.safetensors") if dump_dir else ():
        path.unlink()


def directory_bytes(directory: Path) -> int:
    """The bytes of every file under `directory`: what a dump left on its filesystem."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def dd_rate(directory: Path, megabytes: int) -> float:
    """Bytes/s of `dd bs=1M conv=fsync` writing `megabytes` into `directory`."""
    target = directory / "dd.bin"
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return megabytes * 2**20 / seconds


def drop_from_cache(paths) -> None:
    """Evict files' pages from the page cache (clean pages: written and synced), so that
    the next read of them comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_read_seconds(paths) -> float:
    """Seconds `dd bs=1M` takes to read `paths` one after another, out of the page cache."""
    drop_from_cache(paths)
    started = time.perf_counter()
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    return time.perf_counter() - started


def filesystem(path: Path) -> str:
    """`df -T`'s line for the filesystem holding `path`."""
    return subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()[-1]


def summary(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "raw": values}
