"""Dump the hidden states of every prefilled prompt to disk, for EAGLE-3 draft training.

Turned on by SGLANG_HS_DUMP_DIR. For each request, once its whole prompt has been
prefilled (chunks of a chunked prefill are stitched on the host), one safetensors file
holds

    token_ids          int64 [T]
    hidden_states      [T, K, H] in the model dtype: the residual stream entering each
                       configured layer, in the configured order (transformers'
                       `hidden_states` convention: 0 is the embedding output, L the last
                       layer's output before the final norm)
    last_hidden_state  [T, H]: the final normed state the LM head reads

and then one line is appended to the writer's manifest in <dir>: manifest.jsonl, or
manifest-dp<k>.jsonl for data-parallel rank k > 0, so that writers sharing a directory
never append to, or repair, one another's file; read_manifest reads them all as one. A
file is written under a temporary name and renamed once complete, and its manifest line
follows the rename, so every manifest line names a complete file. File names never
derive from request ids.

With SGLANG_HS_DUMP_DTYPE=fp8 both state tensors are float8 e4m3, each row scaled by its
own amax (hidden_states_scale [T, K] and last_hidden_state_scale [T], float32): about half
the bytes. The metadata's `encoding` says which; load_dump dequantizes by default.

One source for every release the series supports: what differs between releases is
found at runtime (feature checks on the server arguments and on upstream modules), never
kept as copies.

The hooks elsewhere stay thin: ScheduleBatch asks `requests_to_dump` which requests of
an extend batch are dumped, and the model hands its outputs to
`HiddenStatesDumper.capture` after each forward. Rows leave the device without blocking
the forward; background threads stitch, serialize and write them.
"""

import bisect
import fcntl
import importlib.util
import io
import json
import logging
import math
import multiprocessing.util
import os
import queue
import re
import signal
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field, fields
from functools import lru_cache, partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.environ import envs
from sglang.version import __version__

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"
# The dump's own revision within the series, bumped when what it writes or refuses changes.
SERIES_REVISION = 4
SERIES_VERSION = f"{__version__}-{SERIES_REVISION}"
MANIFEST_NAME = "manifest.jsonl"  # data-parallel rank 0's; rank k > 0 writes manifest-dp<k>
MANIFEST_FILE = re.compile(r"^manifest(?:-dp([1-9][0-9]*))?\.jsonl$")
TEMP_PREFIX = ".partial-"
# The encodings SGLANG_HS_DUMP_DTYPE picks (unset: the model's dtype, unconverted).
DTYPES = ("bf16", "fp8")
FP8_ENCODING = "fp8_e4m3_row_scaled"
FP8_MAX = 448.0  # the largest float8 e4m3 (fn) value
# Requests the server sends itself (startup warmup, /health_generate) are never dumped.
INTERNAL_RID_PREFIXES = ("WARMUP_", "HEALTH_CHECK")
# The counters and timings are logged after every error, drop and discard, after the first
# file (the dump works), at exit, then every STATS_LOG_EVERY_FILES files or
# STATS_LOG_INTERVAL_S seconds.
STATS_LOG_INTERVAL_S = 60.0
STATS_LOG_EVERY_FILES = 1000


@lru_cache(maxsize=1)
def dump_enabled() -> bool:
    return bool(envs.SGLANG_HS_DUMP_DIR.get())


@dataclass(frozen=True)
class DumpRequest:
    """What the dump needs to know about one request of an extend batch."""

    rid: str
    prompt_len: int


def wants_dump(req) -> bool:
    """Whether this request's next prefill is dumped: a client request whose prompt has
    not been prefilled whole yet (a retracted request prefills again with output ids),
    and that is not being aborted. An abort (client, timeout, or a request the scheduler
    rejects, whose prompt it replaces by one token) only takes effect once the prefill
    is done, so without this an aborted request would still be dumped."""
    return (
        not req.output_ids
        and req.to_finish is None
        and not req.finished()
        and isinstance(req.rid, str)
        and not req.rid.startswith(INTERNAL_RID_PREFIXES)
    )


def requests_to_dump(reqs) -> List[Optional[DumpRequest]]:
    return [
        DumpRequest(req.rid, len(req.origin_input_ids)) if wants_dump(req) else None
        for req in reqs
    ]


def default_layer_ids(num_layers: int) -> List[int]:
    """EAGLE-3's default, [3, L//2+1, L-2] ([3, 31, 59] for 61 layers); for models too
    shallow for three distinct ids, the distinct ones within 0..L, ascending."""
    candidates = (3, num_layers // 2 + 1, num_layers - 2)
    return sorted({min(max(layer_id, 0), num_layers) for layer_id in candidates})


def parse_layer_ids(spec: Optional[str], num_layers: int) -> List[int]:
    valid = f"the model has L={num_layers} layers, so valid ids are 0..{num_layers}"
    if spec is None or not spec.strip():
        if spec is not None:
            raise ValueError(f"SGLANG_HS_DUMP_LAYERS is empty; {valid}.")
        return default_layer_ids(num_layers)
    try:
        ids = [int(item) for item in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"SGLANG_HS_DUMP_LAYERS={spec!r} is not a comma-separated list of integers; "
            f"{valid}."
        )
    out_of_range = [i for i in ids if not 0 <= i <= num_layers]
    if out_of_range:
        raise ValueError(
            f"SGLANG_HS_DUMP_LAYERS={spec!r}: {out_of_range} out of range; {valid} "
            f"(0 is the embedding output, {num_layers} the last layer's output before "
            f"the final norm)."
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"SGLANG_HS_DUMP_LAYERS={spec!r} repeats a layer id; {valid}.")
    return ids


def check_server_args(server_args) -> None:
    """Refuse the configurations in which a dump would be incomplete or wrong."""
    refusals = []
    if server_args.pp_size > 1:
        refusals.append(
            "pipeline parallelism (--pp-size > 1): each stage only runs its own layers "
            "and aux hidden states are not passed between stages"
        )
    if server_args.speculative_algorithm is not None:
        refusals.append(
            "speculative decoding: it sets its own layers to capture on the target model"
        )
    if getattr(server_args, "enable_return_aux_hidden_states", False):
        refusals.append(
            "--enable-return-aux-hidden-states: it sets its own layers to capture "
            "(--return-aux-hidden-state-layer-ids) on the model"
        )
    if server_args.enable_two_batch_overlap:
        refusals.append(
            "--enable-two-batch-overlap: its overlapped layers run without the capture"
        )
    if (
        getattr(server_args, "enable_piecewise_cuda_graph", False)
        and not prefill_graphs_run_dumps_eagerly()
    ):
        refusals.append(
            "--enable-piecewise-cuda-graph: a replayed prefill does not run the dump hook"
        )
    if refusals:
        raise ValueError(
            "SGLANG_HS_DUMP_DIR is set, but the hidden states dump does not support "
            + "; ".join(refusals)
            + "."
        )


def prefill_graphs_run_dumps_eagerly() -> bool:
    """Whether prefill CUDA graphs leave prefills with dumped requests to run eagerly.
    Releases that route prefill graphs through PrefillCudaGraphRunner get a series patch
    that declines such batches; older ones replay a piecewise graph, which runs no hook."""
    try:
        runner = importlib.util.find_spec(
            "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"
        )
    except ModuleNotFoundError:  # no model_executor.runner package at all
        return False
    return runner is not None


def file_metadata(
    layer_ids: List[int],
    num_layers: int,
    model_path: str,
    dtype: Optional[str] = None,
    model_dtype: Optional[torch.dtype] = None,
) -> Dict[str, str]:
    """The metadata every file of a dump carries (the writer adds each file's rid).
    `dtype` is SGLANG_HS_DUMP_DTYPE's value; fp8 files also name the model dtype that
    load_dump dequantizes to."""
    metadata = {
        "format": FORMAT_VERSION,
        "layer_ids": json.dumps(layer_ids),
        "num_layers": str(num_layers),
        "model_path": str(model_path),
        "sglang_version": __version__,
        "series_version": SERIES_VERSION,
        "encoding": FP8_ENCODING if dtype == "fp8" else "plain",
    }
    if dtype == "fp8":
        metadata["model_dtype"] = str(model_dtype or torch.bfloat16).replace("torch.", "")
    return metadata


def parse_dtype(value: Optional[str]) -> Optional[str]:
    """SGLANG_HS_DUMP_DTYPE: None (the model's dtype), 'bf16' or 'fp8'."""
    if value is None or value == "":
        return None
    if value.lower() not in DTYPES:
        raise ValueError(
            f"SGLANG_HS_DUMP_DTYPE={value!r}: use one of {', '.join(DTYPES)} "
            f"(unset: the model's dtype)."
        )
    return value.lower()


def quantize_rows(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 rows and the float32 scale of each (its amax / FP8_MAX), over the
    last dimension; an all-zero row gets scale 1."""
    amax = rows.abs().amax(dim=-1).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (rows.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (quantized.float() * scale.unsqueeze(-1)).to(dtype)


def default_writer_threads() -> int:
    """Writer threads when SGLANG_HS_DUMP_WRITER_THREADS is 0: a quarter of the host's
    cores, 4 to 16 (one writer alone landed 9 GB/s with 4 threads and 16 GB/s with 8 on
    a 32-core host's tmpfs)."""
    return max(4, min(16, (os.cpu_count() or 4) // 4))


def check_dump_dir(dump_dir: str) -> None:
    try:
        os.makedirs(dump_dir, exist_ok=True)
        probe = os.path.join(dump_dir, f"{TEMP_PREFIX}probe-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"probe")
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"SGLANG_HS_DUMP_DIR={dump_dir!r} is not a writable directory: {e}"
        )


# The tensors of a file, in file order (the scales only in fp8 files).
FILE_TENSORS = (
    "token_ids",
    "hidden_states",
    "last_hidden_state",
    "hidden_states_scale",
    "last_hidden_state_scale",
)


@dataclass
class HostRows:
    """Rows of one forward on their way to the host; valid once `ready` has completed.
    fp8 rows carry their scales."""

    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    ready: Optional[torch.cuda.Event] = None
    hidden_states_scale: Optional[torch.Tensor] = None
    last_hidden_state_scale: Optional[torch.Tensor] = None

    def names(self) -> List[str]:
        """The file's tensors, in file order."""
        return [name for name in FILE_TENSORS if getattr(self, name) is not None]

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class Chunk:
    """One request's rows inside the host rows of one forward."""

    rows: HostRows
    start: int  # row range of this request inside `rows`
    end: int

    def take(self, name: str) -> torch.Tensor:
        return getattr(self.rows, name)[self.start : self.end]


class HostBuffers:
    """Host buffers for the rows of each forward, reused across forwards: a forward's
    buffer comes back once the last file that reads it is written (its HostRows are
    gone), and a later forward takes the smallest free buffer that holds its rows.
    PyTorch's caching host allocator reuses a freed pinned block only for a request of
    the same power-of-two size, so forwards of mixed sizes kept pinning new blocks long
    after warm-up (scripts/bench/pinned.py; BENCHMARKS.md). The pool never holds more
    buffers than were in flight at once."""

    ALIGNMENT = 64  # bytes, of each tensor inside a buffer

    def __init__(self, pin_memory: bool):
        self.pin_memory = pin_memory
        self._lock = threading.Lock()
        self._free: List[torch.Tensor] = []  # uint8 buffers, by ascending size

    def rows(self, tensors: Dict[str, torch.Tensor], **fields_) -> HostRows:
        """Empty host rows shaped like `tensors` (a forward's rows on the device), in one
        buffer of the pool that returns to it with the rows."""
        sizes = [_aligned(t.numel() * t.element_size(), self.ALIGNMENT) for t in tensors.values()]
        buffer = self._take(sum(sizes))
        views, offset = {}, 0
        for (name, tensor), size in zip(tensors.items(), sizes):
            nbytes = tensor.numel() * tensor.element_size()
            views[name] = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            offset += size
        rows = HostRows(**views, **fields_)
        weakref.finalize(rows, self._give_back, buffer).atexit = False
        return rows

    def free_buffers(self) -> List[torch.Tensor]:
        with self._lock:
            return list(self._free)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for index, buffer in enumerate(self._free):
                if buffer.numel() >= nbytes:
                    return self._free.pop(index)
        # At most an eighth more than asked for (2 MiB steps below 32 MiB).
        size = _aligned(nbytes, max(1 << 21, 1 << max(nbytes.bit_length() - 4, 0)))
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)

    def _give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            sizes = [free.numel() for free in self._free]
            self._free.insert(bisect.bisect(sizes, buffer.numel()), buffer)


def _aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


@dataclass
class _Partial:
    """A request whose prompt is prefilled in chunks: the chunks seen so far."""

    request: DumpRequest
    chunks: List[Chunk] = field(default_factory=list)
    num_tokens: int = 0


@dataclass
class _Job:
    request: DumpRequest
    chunks: List[Chunk]
    sequence: int  # submission order, which the manifest keeps


class _LogLine:
    """A dataclass of integers that operators read in the log, as the line `line`
    builds after LOG_PREFIX; `parse` reads the last such line of a log back."""

    LOG_PREFIX = ""

    def line(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, log: str):
        """The values of the last such line in `log` (None: there is none)."""
        pattern = re.escape(cls.LOG_PREFIX) + " ".join(
            rf"{f.name}=(\d+)" for f in fields(cls)
        )
        matches = re.findall(pattern, log)
        return cls(*map(int, matches[-1])) if matches else None


@dataclass(frozen=True)
class DumpCounters(_LogLine):
    """A snapshot of the dump's counters."""

    LOG_PREFIX = "hidden states dump: "

    files: int = 0
    tokens: int = 0
    bytes: int = 0
    errors: int = 0
    dropped: int = 0
    discarded: int = 0


@dataclass(frozen=True)
class DumpTimings(_LogLine):
    """Where the dump's time went, in milliseconds summed since the start: on the
    scheduler thread, taking rows off the forward (`capture_ms`) and waiting for a full
    queue (`blocked_ms`); on the writer threads, waiting for rows to reach the host
    (`copy_wait_ms`), writing and syncing files (`write_ms`), and publishing them in
    submission order, renaming each and appending its manifest line (`manifest_ms`; a
    thread publishes every file that is due, its own and other threads', and never
    waits for another's)."""

    LOG_PREFIX = "hidden states dump timings: "

    capture_ms: int = 0
    blocked_ms: int = 0
    copy_wait_ms: int = 0
    write_ms: int = 0
    manifest_ms: int = 0


class _Stats:
    """The dump's counters and timings (seconds, logged in ms), logged after every
    error, drop and discard, after the first file (the dump works), at exit, then every
    STATS_LOG_EVERY_FILES files or STATS_LOG_INTERVAL_S seconds."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {f.name: 0 for f in fields(DumpCounters)}
        self.seconds = {f.name: 0.0 for f in fields(DumpTimings)}
        self.last_log = time.monotonic()

    def add(self, seconds: Optional[Dict[str, float]] = None, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                self.counts[name] += value
            for name, value in (seconds or {}).items():
                self.seconds[name] += value
            now = time.monotonic()
            files = self.counts["files"]
            due = bool(counts) and (
                "files" not in counts
                or files == 1
                or files % STATS_LOG_EVERY_FILES == 0
                or now - self.last_log > STATS_LOG_INTERVAL_S
            )
        if due:
            self.log()

    def log(self) -> None:
        with self.lock:
            self.last_log = time.monotonic()
            counters, timings = self._snapshot()
        logger.info(f"{DumpCounters.LOG_PREFIX}{counters.line()}")
        logger.info(f"{DumpTimings.LOG_PREFIX}{timings.line()}")

    def _snapshot(self) -> Tuple[DumpCounters, DumpTimings]:
        timings = {name: int(value * 1000) for name, value in self.seconds.items()}
        return DumpCounters(**self.counts), DumpTimings(**timings)

    def snapshot(self) -> DumpCounters:
        with self.lock:
            return self._snapshot()[0]

    def timings(self) -> DumpTimings:
        with self.lock:
            return self._snapshot()[1]


class _InOrder:
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
    (the default) makes the scheduler wait for the disk, so nothing is lost; `drop`
    drops the request's dump and counts it.
    """

    def __init__(
        self,
        dump_dir: str,
        layer_ids: List[int],
        metadata: Dict[str, str],
        queue_size: int = 64,
        on_full: str = "block",
        threads: int = 4,
        manifest_name: str = MANIFEST_NAME,
    ):
        self.dump_dir = dump_dir
        self.manifest_name = manifest_name
        self.layer_ids = list(layer_ids)
        self.on_full = on_full
        self.metadata = metadata
        self.stats = _Stats()
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.sequence = 0  # of the next job submitted; only the scheduler submits
        self.in_order = _InOrder()
        self.queue: "queue.Queue[_Job]" = queue.Queue(maxsize=queue_size)
        self.threads = [
            threading.Thread(
                target=self._run, name=f"hidden-states-dump-writer-{i}", daemon=True
            )
            for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def counters(self) -> DumpCounters:
        return self.stats.snapshot()

    def timings(self) -> DumpTimings:
        return self.stats.timings()

    def submit(self, request: DumpRequest, chunks: List[Chunk]) -> float:
        """Queue one request whose whole prompt is in `chunks`, in prompt order; returns
        the seconds the caller waited for room in the queue. Only one thread submits (the
        scheduler's)."""
        job = _Job(request, chunks, self.sequence)
        blocked = 0.0
        if self.on_full == "drop":
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                logger.warning(
                    f"hidden states dump: queue full, dropped request {job.request.rid!r}"
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

    def write_file(self, job: _Job) -> "_WrittenFile":
        """Write one job's file under its temporary name (on a writer thread); `_publish`
        renames and lists it in its turn."""
        started = time.perf_counter()
        for chunk in job.chunks:
            chunk.rows.wait()
        copied = time.perf_counter()
        parts = {
            name: [chunk.take(name) for chunk in job.chunks]
            for name in job.chunks[0].rows.names()
        }
        num_tokens = sum(part.shape[0] for part in parts["token_ids"])
        hidden_states = parts["hidden_states"][0]
        hidden_size = hidden_states.shape[-1]
        metadata = dict(self.metadata, rid=job.request.rid)
        header = _safetensors_header(parts, num_tokens, metadata)

        name = f"{self.run_id}-{job.sequence + 1:09d}.safetensors"
        temp_path = os.path.join(self.dump_dir, TEMP_PREFIX + name)
        os.makedirs(self.dump_dir, exist_ok=True)
        size = len(header)
        f = open(temp_path, "xb")
        try:
            # Held until the file is published: a writer starting on the same directory
            # removes only temporary files nobody holds.
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(header)
            # The chunks go straight from the host rows to the file: no concatenated
            # copy, no serialized copy.
            for tensors in parts.values():
                for part in tensors:
                    size += f.write(_as_bytes(part))
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.close()
            _remove_quietly(temp_path)
            raise
        line = json.dumps(
            {
                "rid": job.request.rid,
                "file": name,
                "num_tokens": num_tokens,
                "layers": self.layer_ids,
                "hidden_size": hidden_size,
                "dtype": str(hidden_states.dtype).replace("torch.", ""),
            }
        )
        seconds = dict(copy_wait_ms=copied - started, write_ms=time.perf_counter() - copied)
        return _WrittenFile(job.request.rid, name, f, line, num_tokens, size, seconds)

    def _publish(self, written: "_WrittenFile") -> None:
        """Rename a written file to its final name and append its manifest line; renamed
        in turn, so a killed server leaves at most one file not in the manifest."""
        started = time.perf_counter()
        final_path = os.path.join(self.dump_dir, written.name)
        temp_path = os.path.join(self.dump_dir, TEMP_PREFIX + written.name)
        try:
            try:
                os.replace(temp_path, final_path)
            except BaseException:
                _remove_quietly(temp_path)
                raise
            try:
                _append_line(os.path.join(self.dump_dir, self.manifest_name), written.line)
            except BaseException:
                _remove_quietly(final_path)
                raise
        except Exception as e:
            self._failed(written.rid, e)
        else:
            seconds = dict(written.seconds, manifest_ms=time.perf_counter() - started)
            self.stats.add(
                seconds, files=1, tokens=written.num_tokens, bytes=written.size
            )
        finally:
            written.file.close()
            self.queue.task_done()


@dataclass
class _WrittenFile:
    """A job's file, written under its temporary name, waiting for its turn."""

    rid: str
    name: str
    file: io.BufferedWriter  # open, holding its lock
    line: str  # its manifest line
    num_tokens: int
    size: int
    seconds: Dict[str, float]


_SAFETENSORS_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
}


def _safetensors_header(
    parts: Dict[str, List[torch.Tensor]], num_tokens: int, metadata: Dict[str, str]
) -> bytes:
    """The safetensors header of a file whose tensors are the row-wise concatenation of
    `parts`, stored back to back in that order. Metadata values must have a UTF-8 form
    (a lone surrogate in a rid fails here, before anything is written)."""
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensors in parts.items():
        first = tensors[0]
        shape = [num_tokens, *first.shape[1:]]
        size = first.element_size() * num_tokens * math.prod(first.shape[1:])
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[first.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":"))
    encoded = encoded.encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (little-endian hosts), without a copy when
    it is contiguous."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def _append_line(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
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


def _repair_torn_manifest(path: str) -> None:
    """Cut a torn last line (a server killed, or the machine lost, in the middle of
    appending) so that the next line starts on a line of its own. Its file stays, unlisted,
    as after a kill between the rename and the manifest line."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
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
        if _parse_manifest_line(tail) is not None:
            f.write(b"\n")  # complete but for its newline
        else:
            logger.warning(
                f"hidden states dump: removing a torn last line of {path}: {tail[:200]!r}"
            )
            f.truncate(start)
        f.flush()
        os.fsync(f.fileno())


def _parse_manifest_line(line: bytes) -> Optional[dict]:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def drain_before_kill(processes) -> None:
    """Called by the server before it kills its processes (SIGTERM, SIGINT, its own
    shutdown): asks them to terminate, which a writing scheduler does only once it has
    written what it holds (see drain_at_exit), and waits for them at most
    SGLANG_HS_DUMP_DRAIN_TIMEOUT_S seconds. The caller kills what is left."""
    if not dump_enabled() or not processes:
        return
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    # A little longer than the writer's own deadline, so that it can log what it lost.
    psutil.wait_procs(processes, timeout=envs.SGLANG_HS_DUMP_DRAIN_TIMEOUT_S.get() + 5)


def drain_at_exit(writer: DumpWriter) -> None:
    """Write every request already queued before the process goes, at most
    SGLANG_HS_DUMP_DRAIN_TIMEOUT_S seconds, and log what could not be written. Two ways
    out lead here: SIGTERM (the server terminating its processes, drain_before_kill) and
    a scheduler's own return from its event loop (from 0.5.14 a ShutdownReq ends it; the
    writer's daemon threads would end with the process)."""
    draining = threading.Event()

    def drain_and_log():
        if draining.is_set():
            return
        draining.set()
        timeout = envs.SGLANG_HS_DUMP_DRAIN_TIMEOUT_S.get()
        queued = writer.queue.unfinished_tasks
        logger.info(
            f"hidden states dump: exiting; writing {queued} queued requests "
            f"(at most {timeout:g} s)"
        )
        left = writer.drain(timeout)
        if left:
            logger.error(
                f"hidden states dump: exiting with {left} of {queued} queued requests "
                f"not written (SGLANG_HS_DUMP_DRAIN_TIMEOUT_S={timeout:g})"
            )
        else:
            logger.info(
                f"hidden states dump: wrote the {queued} queued requests before exiting"
            )
        writer.stats.log()

    # Run by multiprocessing when a child process (a scheduler) returns normally.
    multiprocessing.util.Finalize(None, drain_and_log, exitpriority=100)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    previous = signal.getsignal(signal.SIGTERM)

    def drain_then_terminate(signum, frame):
        if draining.is_set():
            return  # a drain is under way in this thread: let it finish
        drain_and_log()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, drain_then_terminate)


def manifest_name(dp_rank: int) -> str:
    return MANIFEST_NAME if dp_rank == 0 else f"manifest-dp{dp_rank}.jsonl"


def manifest_paths(dump_dir: str) -> List[str]:
    """Every writer's manifest in `dump_dir`: data-parallel rank 0's first, then by rank."""
    try:
        names = os.listdir(dump_dir)
    except FileNotFoundError:
        return []
    ranked = [(int(m.group(1) or 0), name) for name in names if (m := MANIFEST_FILE.match(name))]
    return [os.path.join(dump_dir, name) for _, name in sorted(ranked)]


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


def _server_args_and_ranks():
    """This process's server arguments and its (attention-TP rank, attention-DP rank or 0
    without DP attention, last pipeline stage?). 0.5.23 serves them from
    sglang.srt.runtime_context (get_global_server_args is retired there); older releases
    from module-level getters."""
    try:
        from sglang.srt.runtime_context import get_parallel, get_server_args
    except ImportError:
        from sglang.srt.distributed import get_pp_group
        from sglang.srt.layers.dp_attention import (
            get_attention_dp_rank,
            get_attention_tp_rank,
        )
        from sglang.srt.server_args import get_global_server_args

        server_args = get_global_server_args()
        dp_rank = get_attention_dp_rank() if server_args.enable_dp_attention else 0
        return server_args, (get_attention_tp_rank(), dp_rank, get_pp_group().is_last_rank)
    server_args, parallel = get_server_args(), get_parallel()
    dp_rank = parallel.attn_dp_rank if server_args.enable_dp_attention else 0
    return server_args, (parallel.attn_tp_rank, dp_rank, parallel.pp_group.is_last_rank)


class HiddenStatesDumper:
    """One per model replica. Every rank validates the configuration the same way; only
    the rank that writes for its data-parallel group copies rows and writes files."""

    def __init__(
        self,
        dump_dir: str,
        layer_ids: List[int],
        is_writer: bool,
        metadata,
        dp_rank: int = 0,
        dtype: Optional[str] = None,
    ):
        self.dump_dir = dump_dir
        self.layer_ids = layer_ids
        self.dtype = dtype  # SGLANG_HS_DUMP_DTYPE: None (the model's), "bf16" or "fp8"
        self._copy_stream = None  # device-to-host copies leave the forward's stream
        self.host_buffers = HostBuffers(pin_memory=torch.cuda.is_available())
        # The model appends aux hidden states as its layers run, i.e. by ascending id.
        self._aux_order = [sorted(layer_ids).index(i) for i in layer_ids]
        self.is_writer = is_writer
        self._partials: Dict[str, _Partial] = {}
        self._writer = None
        if is_writer:
            manifest = manifest_name(dp_rank)
            remove_stale_temp_files(dump_dir)
            _repair_torn_manifest(os.path.join(dump_dir, manifest))
            self._writer = DumpWriter(
                dump_dir,
                layer_ids,
                metadata,
                queue_size=envs.SGLANG_HS_DUMP_QUEUE_SIZE.get(),
                on_full=envs.SGLANG_HS_DUMP_ON_FULL_QUEUE.get(),
                threads=envs.SGLANG_HS_DUMP_WRITER_THREADS.get()
                or default_writer_threads(),
                manifest_name=manifest,
            )
            drain_at_exit(self._writer)
            eager = (
                "; prefills with dumped requests run without prefill CUDA graphs"
                if prefill_graphs_run_dumps_eagerly()
                else ""
            )
            logger.info(
                f"hidden states dump on: dir={dump_dir} manifest={manifest} layers={layer_ids} "
                f"(of L={metadata['num_layers']}) encoding={metadata['encoding']} "
                f"writer_threads={len(self._writer.threads)}{eager}"
            )

    @classmethod
    def from_env(cls, config) -> Optional["HiddenStatesDumper"]:
        if not dump_enabled():
            return None
        server_args, (attn_tp_rank, dp_rank, last_pp_stage) = _server_args_and_ranks()
        check_server_args(server_args)
        dump_dir = envs.SGLANG_HS_DUMP_DIR.get()
        num_layers = config.num_hidden_layers
        layer_ids = parse_layer_ids(envs.SGLANG_HS_DUMP_LAYERS.get(), num_layers)
        on_full = envs.SGLANG_HS_DUMP_ON_FULL_QUEUE.get()
        if on_full not in ("block", "drop"):
            raise ValueError(
                f"SGLANG_HS_DUMP_ON_FULL_QUEUE={on_full!r}: use 'block' or 'drop'."
            )
        if envs.SGLANG_HS_DUMP_QUEUE_SIZE.get() < 1:
            raise ValueError("SGLANG_HS_DUMP_QUEUE_SIZE must be at least 1.")
        if envs.SGLANG_HS_DUMP_WRITER_THREADS.get() < 0:
            raise ValueError(
                "SGLANG_HS_DUMP_WRITER_THREADS must not be negative (0: from the host's cores)."
            )
        dtype = parse_dtype(envs.SGLANG_HS_DUMP_DTYPE.get())
        if envs.SGLANG_HS_DUMP_DRAIN_TIMEOUT_S.get() < 0:
            raise ValueError("SGLANG_HS_DUMP_DRAIN_TIMEOUT_S must not be negative.")
        check_dump_dir(dump_dir)
        # The model is being built under its own default dtype.
        metadata = file_metadata(
            layer_ids, num_layers, server_args.model_path, dtype, torch.get_default_dtype()
        )
        is_writer = attn_tp_rank == 0 and last_pp_stage
        return cls(dump_dir, layer_ids, is_writer, metadata, dp_rank, dtype)

    def counters(self) -> Optional[DumpCounters]:
        """The counters of this replica's writer (None on ranks that do not write)."""
        return self._writer.counters() if self._writer else None

    def timings(self) -> Optional[DumpTimings]:
        return self._writer.timings() if self._writer else None

    def capture(
        self,
        forward_batch,
        hidden_states: torch.Tensor,
        aux_hidden_states: Optional[Sequence[torch.Tensor]],
    ) -> None:
        requests = forward_batch.hidden_states_dump_requests
        if requests is None or not self.is_writer:
            return
        started = time.perf_counter()
        spans, continuing = self._spans(forward_batch, requests)
        self._discard_abandoned(continuing)
        if not spans:
            return
        rows = self._copy_to_host(forward_batch, hidden_states, aux_hidden_states, spans)
        offset, blocked = 0, 0.0
        for request, prefix_len, start, end in spans:
            chunk = Chunk(rows, offset, offset + end - start)
            offset += end - start
            blocked += self._add_chunk(request, prefix_len, chunk)
        elapsed = time.perf_counter() - started
        self._writer.stats.add(seconds=dict(capture_ms=elapsed - blocked))

    def _spans(self, forward_batch, requests):
        """(request, prefix_len, first row, end row) of each dumped request's prompt rows in
        this forward, and the rids the forward continues."""
        spans, continuing = [], set()
        start = 0
        for request, prefix_len, extend_len in zip(
            requests,
            forward_batch.extend_prefix_lens_cpu,
            forward_batch.extend_seq_lens_cpu,
        ):
            if request is not None:
                continuing.add(request.rid)
                prompt_rows = min(extend_len, request.prompt_len - prefix_len)
                if prompt_rows > 0:
                    spans.append((request, prefix_len, start, start + prompt_rows))
            start += extend_len
        return spans, continuing

    def _discard_abandoned(self, continuing) -> None:
        # The scheduler puts a request that is being prefilled in chunks into every
        # next prefill batch until its prompt is done; one missing from this batch was
        # aborted or retracted, and its chunks are dropped.
        for rid in [rid for rid in self._partials if rid not in continuing]:
            partial = self._partials.pop(rid)
            logger.info(
                f"hidden states dump: request {rid!r} left after "
                f"{partial.num_tokens} of {partial.request.prompt_len} prompt tokens; "
                f"nothing written"
            )
            self._writer.stats.add(discarded=1)

    def _copy_to_host(self, forward_batch, hidden_states, aux_hidden_states, spans):
        if hidden_states.device.type == "cpu":
            device_rows = self._rows(forward_batch, hidden_states, aux_hidden_states, spans)
            host_rows = self.host_buffers.rows(device_rows)
            for name, tensor in device_rows.items():
                getattr(host_rows, name).copy_(tensor)
            return host_rows
        # On their own stream, so the next forward does not wait for the copies; the
        # inputs, made on the forward's stream, stay allocated until the copies are done.
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            device_rows = self._rows(forward_batch, hidden_states, aux_hidden_states, spans)
            host_rows = self.host_buffers.rows(device_rows, ready=torch.cuda.Event())
            for name, tensor in device_rows.items():
                getattr(host_rows, name).copy_(tensor, non_blocking=True)
            host_rows.ready.record(stream)
        inputs = [forward_batch.input_ids, hidden_states]
        inputs += [aux_hidden_states] if isinstance(aux_hidden_states, torch.Tensor) else list(aux_hidden_states)
        for tensor in inputs:
            tensor.record_stream(stream)
        return host_rows

    def _rows(self, forward_batch, hidden_states, aux_hidden_states, spans):
        """The dumped requests' rows of this forward, in the file's form: token ids,
        captured layers [T, K, H] in the configured order, the final state, converted
        or quantized as SGLANG_HS_DUMP_DTYPE says."""

        def dumped_rows(tensor: torch.Tensor) -> torch.Tensor:
            if len(spans) == 1 or all(a[3] == b[2] for a, b in zip(spans, spans[1:])):
                return tensor[spans[0][2] : spans[-1][3]]
            return torch.cat([tensor[start:end] for _, _, start, end in spans])

        if isinstance(aux_hidden_states, torch.Tensor):
            # Packed by upstream's AuxHiddenStatePacker (0.5.23): [T, K * H], by ascending id.
            layers = dumped_rows(aux_hidden_states).unflatten(-1, (len(self._aux_order), -1))
            aux_rows = layers[:, self._aux_order]
        else:
            aux_rows = torch.stack(
                [dumped_rows(aux_hidden_states[j]) for j in self._aux_order], dim=1
            )
        rows = {
            "token_ids": dumped_rows(forward_batch.input_ids).to(torch.int64),
            "hidden_states": aux_rows,
            "last_hidden_state": dumped_rows(hidden_states),
        }
        if self.dtype == "bf16":
            for name in ("hidden_states", "last_hidden_state"):
                rows[name] = rows[name].to(torch.bfloat16)
        elif self.dtype == "fp8":
            for name in ("hidden_states", "last_hidden_state"):
                rows[name], rows[f"{name}_scale"] = quantize_rows(rows[name])
        return rows

    def _add_chunk(self, request: DumpRequest, prefix_len: int, chunk: Chunk) -> float:
        """Add a chunk to its request and submit the request once its prompt is whole;
        returns the seconds the submit waited for the queue."""
        partial = self._partials.pop(request.rid, None)
        if prefix_len == 0:
            partial = _Partial(request)
        elif partial is None or partial.num_tokens != prefix_len:
            have = 0 if partial is None else partial.num_tokens
            logger.error(
                f"hidden states dump: request {request.rid!r} has no hidden states for "
                f"prompt positions {have}..{prefix_len}; nothing written"
            )
            self._writer.stats.add(errors=1)
            return 0.0
        partial.chunks.append(chunk)
        partial.num_tokens += chunk.end - chunk.start
        if partial.num_tokens >= request.prompt_len:
            return self._writer.submit(request, partial.chunks)
        self._partials[request.rid] = partial
        return 0.0


@dataclass
class DumpRecord:
    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    metadata: Dict[str, str]
    # Only when an fp8 file is read raw: float32 scales, one per row.
    hidden_states_scale: Optional[torch.Tensor] = None
    last_hidden_state_scale: Optional[torch.Tensor] = None

    @property
    def layer_ids(self) -> List[int]:
        return json.loads(self.metadata["layer_ids"])

    @property
    def encoding(self) -> str:
        return self.metadata.get("encoding", "plain")


def load_dump(path: str, raw: bool = False) -> DumpRecord:
    """Read one dumped file: the writer's twin, used by tests and tools. fp8 states come
    back dequantized to the model's dtype, or as stored (with their scales) when `raw`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
        metadata = f.metadata()
    record = DumpRecord(metadata=metadata, **tensors)
    if record.encoding == FP8_ENCODING and not raw:
        dtype = getattr(torch, metadata["model_dtype"])
        record.hidden_states = dequantize_rows(
            record.hidden_states, record.hidden_states_scale, dtype
        )
        record.last_hidden_state = dequantize_rows(
            record.last_hidden_state, record.last_hidden_state_scale, dtype
        )
        record.hidden_states_scale = record.last_hidden_state_scale = None
    return record


def read_manifest(dump_dir: str) -> List[dict]:
    """The entries of every writer's manifest in `dump_dir`, each manifest in its order
    (see manifest_paths). A torn last line (a line being appended, or one a killed server
    left) is not an entry; a line that does not parse elsewhere is an error."""
    entries = []
    for path in manifest_paths(dump_dir):
        with open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                entry = _parse_manifest_line(line)
                if entry is None:
                    if not line.endswith(b"\n"):  # the last line, torn
                        break
                    raise ValueError(
                        f"{path}:{number}: not a manifest entry: {line[:200]!r}"
                    )
                entries.append(entry)
    return entries
