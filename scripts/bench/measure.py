"""Measuring helpers the benchmarks share: workloads, sending them, waiting for their files
to land, the disk's own rate, and summaries of repeated measurements."""

import random
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scripts.dumps.server import Server, manifest_lines


def prompts_for(count: int, length: int, seed: int) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(count)]


def send_all(server: Server, prompts, **extra) -> float:
    """Seconds to prefill every prompt (one output token each), all sent at once."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(64, len(prompts))) as pool:
        list(pool.map(lambda p: server.generate(p, max_new_tokens=1, **extra), prompts))
    return time.perf_counter() - started


def wait_for_lines(dump_dir: Path, target: int, started: float, timeout: float) -> None:
    """Wait until the manifest of `dump_dir` holds `target` lines."""
    while manifest_lines(dump_dir) < target:
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"{dump_dir}: {manifest_lines(dump_dir)} of {target} manifest lines after {timeout}s")
        time.sleep(0.002)


def send_and_land(server: Server, prompts, dump_dir: Optional[Path] = None, timeout: float = 600) -> float:
    """Seconds to prefill every prompt (all sent at once) and, for a dumping server, until
    the manifest names a file for each: the writer's backlog is part of the cost."""
    return send_and_land_split(server, prompts, dump_dir, timeout)[1]


def send_and_land_split(server: Server, prompts, dump_dir: Optional[Path] = None,
                        timeout: float = 600) -> Tuple[float, float]:
    """send_and_land's seconds to the last response and to the last file landed."""
    started = time.perf_counter()
    target = manifest_lines(dump_dir) + len(prompts) if dump_dir else 0
    send_all(server, prompts)
    responded = time.perf_counter() - started
    if dump_dir:
        wait_for_lines(dump_dir, target, started, timeout)
    return responded, time.perf_counter() - started


def clear_files(dump_dir: Optional[Path]) -> None:
    """Remove the dumped files (the manifest stays, for counting), so a long run neither
    fills the disk nor measures a disk whose cache is full of earlier rounds."""
    for path in dump_dir.glob("*.safetensors") if dump_dir else ():
        path.unlink()


def dd_rate(directory: Path, megabytes: int) -> float:
    """Bytes/s of `dd bs=1M conv=fsync` writing `megabytes` into `directory`."""
    target = directory / "dd.bin"
    started = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - started
    target.unlink()
    return megabytes * 2**20 / seconds


def filesystem(path: Path) -> str:
    """`df -T`'s line for the filesystem holding `path`."""
    return subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout.splitlines()[-1]


def summary(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "raw": values}
