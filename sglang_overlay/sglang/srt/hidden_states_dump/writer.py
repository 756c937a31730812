"""Writer threads: complete requests become files, published in submission order.

A file is written and fsynced under a temporary name, renamed once complete, and then
its manifest line is appended, so every manifest line names a complete file and a killed
server leaves at most one renamed file that no line names. File names never derive from
request ids.
"""

import fcntl
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List

from sglang.srt.hidden_states_dump.format import (
    TEMP_PREFIX,
    DumpCounters,
    DumpTimings,
    manifest_entry,
    parse_manifest_line,
    safetensors_header,
    tensor_bytes,
)
from sglang.srt.hidden_states_dump.host_buffers import Chunk
from sglang.srt.hidden_states_dump.requests import DumpRequest
from sglang.srt.hidden_states_dump.stats import DumpStats

logger = logging.getLogger(__name__)

# The most buffers one writev takes.
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


@dataclass
class WriteJob:
    request: DumpRequest
    chunks: List[Chunk]  # the request's whole prompt, in prompt order
    sequence: int  # submission order, which the manifest keeps


@dataclass
class WrittenFile:
    """A job's file, written under its temporary name, waiting for its turn."""

    rid: str
    name: str
    temp_path: str
    fd: int  # open, holding its lock
    line: str  # its manifest line
    num_tokens: int
    size: int
    seconds: Dict[str, float]


class InOrder:
    """Publishes the jobs that several threads take from one FIFO queue in the order they
    were submitted, without a thread waiting for the jobs before its own: each thread
    hands its finished job over and goes on, and the thread that hands over the job that
    is due publishes it and every handed-over job due after it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 0  # the sequence due
        self._finished: Dict[int, Callable[[], None]] = {}
        self._publishing = False

    def finish(self, sequence: int, publish: Callable[[], None]) -> None:
        """Hand over job `sequence`: `publish` runs once every earlier job's has, on
        whichever thread gets there (this one, or one publishing already). It must not
        raise."""
        with self._lock:
            self._finished[sequence] = publish
            if self._publishing:
                return  # the publishing thread will reach it
            self._publishing = True
        while True:
            with self._lock:
                publish = self._finished.pop(self._next, None)
                if publish is None:
                    self._publishing = False
                    return
                self._next += 1
            publish()


class DumpWriter:
    """Background threads that turn complete requests into files, fed by a bounded
    queue. Files are written and fsynced in parallel under temporary names, then renamed
    and listed in the manifest in the order they were submitted. Needs no server: feed it
    host rows with `submit`.

    When the queue is full (every thread busy and `queue_size` jobs waiting), `block`
    makes the scheduler wait for the disk, so nothing is lost; `drop` drops the
    request's dump and counts it.
    """

    def __init__(
        self,
        dump_dir: str,
        metadata: Dict[str, str],
        *,
        queue_size: int,
        on_full_queue: str,
        threads: int,
        manifest_name: str,
    ):
        self.dump_dir = dump_dir
        self.manifest_name = manifest_name
        self.on_full_queue = on_full_queue
        self.metadata = metadata
        self.stats = DumpStats()
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.sequence = 0  # of the next job submitted; only the scheduler submits
        self.in_order = InOrder()
        self.queue: "queue.Queue[WriteJob]" = queue.Queue(maxsize=queue_size)
        self.threads = [
            threading.Thread(
                target=self._run, name=f"hidden-states-dump-writer-{i}", daemon=True
            )
            for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def counters(self) -> DumpCounters:
        return self.stats.counters()

    def timings(self) -> DumpTimings:
        return self.stats.timings()

    def submit(self, request: DumpRequest, chunks: List[Chunk]) -> float:
        """Queue one request whose whole prompt is in `chunks`, in prompt order; returns
        the seconds the caller waited for room in the queue. Only one thread submits (the
        scheduler's)."""
        job = WriteJob(request, chunks, self.sequence)
        blocked = 0.0
        if self.on_full_queue == "drop":
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                logger.warning(
                    f"hidden states dump: queue full, dropped request {request.rid!r}"
                )
                self.stats.add(dropped=1)
                return blocked
        else:
            started = time.perf_counter()
            self.queue.put(job)
            blocked = time.perf_counter() - started
            self.stats.add(seconds=dict(blocked_ms=blocked))
        self.sequence += 1
        return blocked

    def drain(self, timeout: float) -> int:
        """Wait until every submitted request is written (or has failed), at most
        `timeout` seconds; returns how many are still not written."""
        deadline = time.monotonic() + timeout
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.queue.all_tasks_done.wait(left)
            return self.queue.unfinished_tasks

    def queued(self) -> int:
        """Requests submitted and not yet written or failed."""
        return self.queue.unfinished_tasks

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            sequence = job.sequence
            try:
                publish = partial(self._publish, self.write_file(job))
            except Exception as e:
                self._failed(job.request.rid, e)
                publish = self.queue.task_done
            # The job's host rows are released before its turn comes.
            del job
            self.in_order.finish(sequence, publish)

    def _failed(self, rid: str, error: BaseException) -> None:
        logger.error(f"hidden states dump: request {rid!r} not written: {error!r}")
        self.stats.add(errors=1)

    def write_file(self, job: WriteJob) -> WrittenFile:
        """Write one job's file under its temporary name (on a writer thread); `_publish`
        renames and lists it in its turn."""
        started = time.perf_counter()
        for chunk in job.chunks:
            chunk.wait()
        copied = time.perf_counter()
        parts = {
            name: [chunk.take(name) for chunk in job.chunks]
            for name in job.chunks[0].rows.names()
        }
        num_tokens = sum(part.shape[0] for part in parts["token_ids"])
        header = safetensors_header(parts, num_tokens, dict(self.metadata, rid=job.request.rid))

        name = f"{self.run_id}-{job.sequence + 1:09d}.safetensors"
        temp_path = os.path.join(self.dump_dir, TEMP_PREFIX + name)
        fd = open_new_file(temp_path)
        try:
            # Held until the file is published: a writer starting on the same directory
            # removes only temporary files nobody holds.
            fcntl.flock(fd, fcntl.LOCK_EX)
            # The chunks go straight from the host rows to the file, in as few system calls
            # as the kernel takes: no concatenated copy, no serialized copy.
            size = write_all(
                fd, [header, *(tensor_bytes(part) for tensors in parts.values() for part in tensors)]
            )
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            remove_quietly(temp_path)
            raise
        entry = manifest_entry(
            job.request.rid, name, num_tokens, self.metadata, parts["hidden_states"][0]
        )
        seconds = dict(copy_wait_ms=copied - started, write_ms=time.perf_counter() - copied)
        return WrittenFile(job.request.rid, name, temp_path, fd, json.dumps(entry), num_tokens, size, seconds)

    def _publish(self, written: WrittenFile) -> None:
        """Rename a written file to its final name and append its manifest line; renamed
        in turn, so a killed server leaves at most one file not in the manifest."""
        started = time.perf_counter()
        final_path = os.path.join(self.dump_dir, written.name)
        try:
            try:
                os.replace(written.temp_path, final_path)
            except BaseException:
                remove_quietly(written.temp_path)
                raise
            try:
                append_line(os.path.join(self.dump_dir, self.manifest_name), written.line)
            except BaseException:
                remove_quietly(final_path)
                raise
        except Exception as e:
            self._failed(written.rid, e)
        else:
            seconds = dict(written.seconds, manifest_ms=time.perf_counter() - started)
            self.stats.add(seconds, files=1, tokens=written.num_tokens, bytes=written.size)
        finally:
            os.close(written.fd)
            self.queue.task_done()


def open_new_file(path: str) -> int:
    """Create `path` for writing (it must not exist), and its directory if that is gone (a
    dump directory removed under a running server is made again)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o644)


def write_all(fd: int, buffers: List[memoryview]) -> int:
    """Write `buffers` back to back at the file's position with as few writev calls as the
    kernel takes (each at most IOV_MAX buffers; a short write resumes where it stopped);
    returns the bytes written."""
    pending = [memoryview(buffer).cast("B") for buffer in buffers]
    pending = [buffer for buffer in pending if len(buffer)]
    total = 0
    while pending:
        written = os.writev(fd, pending[:IOV_MAX])
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        total += written
        while pending and written >= len(pending[0]):
            written -= len(pending.pop(0))
        if written:
            pending[0] = pending[0][written:]
    return total


def append_line(path: str, line: str) -> None:
    """Append one line. The manifest is locked while the line is written: writers sharing
    it (servers given one writer id) append whole lines, and a writer starting on it repairs
    only a line no live writer is still appending (repair_torn_manifest)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        data = (line + "\n").encode("utf-8")
        try:
            if os.write(fd, data) != len(data):
                raise OSError(f"short write to {path}")
            os.fsync(fd)
        except BaseException:
            # A part of a line (a full disk) would join the next line appended.
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def repair_torn_manifest(path: str) -> None:
    """Cut a torn last line (a server killed, or the machine lost, in the middle of
    appending) so that the next line starts on a line of its own. Its file stays, unlisted,
    as after a kill between the rename and the manifest line."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits for a line being appended (append_line)
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        start = end
        while start > 0:
            block_start = max(start - (1 << 16), 0)
            f.seek(block_start)
            newline = f.read(start - block_start).rfind(b"\n")
            if newline >= 0:
                start = block_start + newline + 1
                break
            start = block_start
        f.seek(start)
        tail = f.read()
        if parse_manifest_line(tail) is not None:
            f.write(b"\n")  # complete but for its newline
        else:
            logger.warning(
                f"hidden states dump: removing a torn last line of {path}: {tail[:200]!r}"
            )
            f.truncate(start)
        f.flush()
        os.fsync(f.fileno())


def remove_stale_temp_files(dump_dir: str) -> None:
    """Remove temporary files left by a writer killed in the middle of a write. A file a
    live writer holds (another data-parallel rank's, or another server's) stays."""
    for name in os.listdir(dump_dir):
        if not name.startswith(TEMP_PREFIX):
            continue
        path = os.path.join(dump_dir, name)
        try:
            with open(path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.remove(path)
        except BlockingIOError:
            continue
        except OSError:
            pass


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
