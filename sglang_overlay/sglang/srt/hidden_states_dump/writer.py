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
from typing import Dict, List, Sequence

import torch

from sglang.srt.hidden_states_dump.files import (
    InOrder,
    cut_torn_last_line,
    publish_file,
    with_checksum,
    write_temp_file,
)
from sglang.srt.hidden_states_dump.format import (
    TEMP_PREFIX,
    DumpCounters,
    DumpTimings,
    manifest_entry,
    safetensors_header,
    tensor_bytes,
)
from sglang.srt.hidden_states_dump.host_buffers import Chunk
from sglang.srt.hidden_states_dump.requests import DumpRequest, report_location
from sglang.srt.hidden_states_dump.stats import DumpStats

logger = logging.getLogger(__name__)


@dataclass
class WriteJob:
    request: DumpRequest
    chunks: List[Chunk]  # the request's whole prompt, in prompt order
    sequence: int  # submission order, which the manifest keeps


@dataclass
class FileContents:
    """One job's file: its header, then its tensors' bytes, once its rows have landed."""

    name: str
    header: bytes
    parts: Dict[str, List[torch.Tensor]]  # each tensor's chunks: views of the host rows
    tensors: List[torch.Tensor]  # the same views, in file order
    line: str  # its manifest line
    num_tokens: int
    copy_wait: float  # seconds the rows took to land


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
        self.run_id = new_run_id()
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
        if request.req is not None:
            report_location(request.req, self.location(job))
        return blocked

    def location(self, job: WriteJob) -> dict:
        """Where a queued job's sample will be once its manifest line is published: what
        its request's response reports (and its manifest line says)."""
        return {"sink": "files", "manifest": self.manifest_name, "file": file_name(self.run_id, job.sequence)}

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

    def full(self) -> bool:
        """Whether a submit now would wait for room (or drop, under `drop`)."""
        return self.queue.full()

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
        self._failed_as(rid, repr(error))

    def _failed_as(self, rid: str, error: str) -> None:
        logger.error(f"hidden states dump: request {rid!r} not written: {error}")
        self.stats.add(errors=1)

    def file_contents(self, job: WriteJob) -> "FileContents":
        """What one job's file holds, once its rows have landed (on a writer thread)."""
        started = time.perf_counter()
        for chunk in job.chunks:
            chunk.wait()
        copied = time.perf_counter()
        parts = {
            name: [chunk.take(name) for chunk in job.chunks]
            for name in job.chunks[0].rows.names()
        }
        num_tokens = sum(part.shape[0] for part in parts["token_ids"])
        if job.request.token_ids is not None:
            check_token_ids(parts["token_ids"], job.request.token_ids)
        header = safetensors_header(parts, num_tokens, dict(self.metadata, rid=job.request.rid))
        name = file_name(self.run_id, job.sequence)
        nonfinite_rows = sum(chunk.nonfinite_rows() for chunk in job.chunks)
        if nonfinite_rows:
            logger.warning(
                f"hidden states dump: request {job.request.rid!r} has {nonfinite_rows} of "
                f"{num_tokens} rows holding NaN or infinity; flagged in its manifest line"
            )
            self.stats.add(nonfinite=1)
        entry = manifest_entry(
            job.request.rid, name, num_tokens, self.metadata, parts["hidden_states"][0], nonfinite_rows,
            job.request.asked, job.request.answer_tokens,
        )
        tensors = [part for tensors in parts.values() for part in tensors]
        return FileContents(name, header, parts, tensors, json.dumps(entry), num_tokens, copied - started)

    def write_file(self, job: WriteJob) -> WrittenFile:
        """Write one job's file under its temporary name (on a writer thread); `_publish`
        renames and lists it in its turn."""
        contents = self.file_contents(job)
        started = time.perf_counter()
        # The chunks go straight from the host rows to the file, in as few system calls as
        # the kernel takes: no concatenated copy, no serialized copy.
        temp_path, fd, size, checksum = write_temp_file(
            self.dump_dir, contents.name, [contents.header, *map(tensor_bytes, contents.tensors)]
        )
        seconds = dict(copy_wait_ms=contents.copy_wait, write_ms=time.perf_counter() - started)
        line = with_checksum(contents.line, checksum)
        return WrittenFile(
            job.request.rid, contents.name, temp_path, fd, line, contents.num_tokens, size, seconds
        )

    def _publish(self, written: WrittenFile) -> None:
        """Rename a written file to its final name and append its manifest line; renamed
        in turn, so a killed server leaves at most one file not in the manifest."""
        started = time.perf_counter()
        try:
            publish_file(
                self.dump_dir, self.manifest_name, written.name, written.temp_path, written.line
            )
        except Exception as e:
            self._failed(written.rid, e)
        else:
            seconds = dict(written.seconds, manifest_ms=time.perf_counter() - started)
            self.stats.add(seconds, files=1, tokens=written.num_tokens, bytes=written.size)
        finally:
            os.close(written.fd)
            self.queue.task_done()


def check_token_ids(parts: List[torch.Tensor], token_ids: Sequence[int]) -> None:
    """ValueError unless the rows' token ids, in order, are `token_ids` (a request's prompt and
    answer): rows placed at other positions than the tokens fed back are not written."""
    have = torch.cat(parts).tolist() if parts else []
    if have == list(token_ids):
        return
    first = next((i for i, (a, b) in enumerate(zip(have, token_ids)) if a != b), min(len(have), len(token_ids)))
    raise ValueError(
        f"its rows hold {len(have)} token ids, its prompt and answer {len(token_ids)}; they "
        f"first differ at position {first}"
    )


def new_run_id() -> str:
    """A writer's run: when it started, and enough randomness that no two runs share one."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"


def file_name(run_id: str, sequence: int) -> str:
    """The file of a writer's job `sequence` (from 0): never derived from a request id."""
    return f"{run_id}-{sequence + 1:09d}.safetensors"


def repair_torn_manifest(path: str) -> None:
    """Cut a torn last line (a server killed, or the machine lost, in the middle of
    appending) so that the next line starts on a line of its own. Its file stays, unlisted,
    as after a kill between the rename and the manifest line."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for a line being appended (append_line)
        torn = cut_torn_last_line(fd)
    finally:
        os.close(fd)
    if torn is not None:
        logger.warning(f"hidden states dump: removing a torn last line of {path}: {torn[:200]!r}")


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
