"""The dump's settings, read from the environment once and frozen.

Every setting is an environment variable declared in sglang/srt/environ.py's Envs, where
its one default lives; DumpConfig.from_env reads each once, checks it, and is the only
reader. The layer ids depend on the model, so they are resolved by `layer_ids`.
"""

import hashlib
import math
import os
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional

from sglang.srt.environ import envs
from sglang.srt.hidden_states_dump.format import TEMP_PREFIX
from sglang.srt.hidden_states_dump.store_settings import MooncakeSettings

# The encodings SGLANG_HS_DUMP_DTYPE picks (unset: the model's dtype, unconverted).
DTYPES = ("bf16", "fp8")
ON_FULL_QUEUE = ("block", "drop")
# Where the rows go (SGLANG_HS_DUMP_SINK): files in the dump directory, or a Mooncake store,
# in one of the layouts the field's online trainers read (SGLANG_HS_DUMP_SINK_LAYOUT).
SINKS = ("files", "mooncake")
STORE_LAYOUTS = ("specforge", "hs-connectors")
MAX_WRITER_ID_LENGTH = 64
DP_RANK_SUFFIX = re.compile(r"(?:^|-)dp[0-9]+$")  # a writer id must not read as a rank


# This process's replica of a data-parallel server (--dp-size without DP attention), which
# the scheduler process sets before it builds the model; None: not such a replica.
_data_parallel_rank: Optional[int] = None


def set_data_parallel_rank(dp_rank: Optional[int]) -> None:
    global _data_parallel_rank
    _data_parallel_rank = dp_rank


def data_parallel_rank() -> Optional[int]:
    return _data_parallel_rank


@lru_cache(maxsize=1)
def dump_enabled() -> bool:
    """The hot path's one check (cached: the environment is read once)."""
    return bool(envs.SGLANG_HS_DUMP_DIR.get())


@dataclass(frozen=True)
class RequestSample:
    """Which client requests the dump takes when they neither ask for a dump nor decline
    one (hidden_states_dump_requests): a fraction of them (SGLANG_HS_DUMP_SAMPLE; 1: all,
    0: only those that ask), chosen by a keyed hash of each request's id under
    SGLANG_HS_DUMP_SAMPLE_SEED. The choice depends on nothing else, so every rank, every
    chunk of a prefill and every rerun of the same request id chooses alike."""

    fraction: float = 1.0
    seed: int = 0

    def takes(self, rid: str) -> bool:
        if self.fraction >= 1:
            return True
        if self.fraction <= 0:
            return False
        digest = hashlib.blake2b(
            rid.encode("utf-8", "surrogatepass"), digest_size=8, key=self.seed.to_bytes(8, "little")
        ).digest()
        return int.from_bytes(digest, "little") < self.fraction * 2**64

    def description(self) -> str:
        if self.fraction >= 1:
            return "all"
        if self.fraction <= 0:
            return "asked"
        return f"asked+sample(fraction={self.fraction:g},seed={self.seed})"

    def recorded(self) -> Optional[dict]:
        """What the dump's metadata and manifest lines record (None: every request is taken)."""
        return None if self.fraction >= 1 else {"fraction": self.fraction, "seed": self.seed}


@lru_cache(maxsize=1)
def request_sample() -> RequestSample:
    """The server's RequestSample, read once and checked (ValueError names the variable)."""
    fraction = envs.SGLANG_HS_DUMP_SAMPLE.get()
    if not (math.isfinite(fraction) and 0 <= fraction <= 1):
        raise ValueError(
            f"SGLANG_HS_DUMP_SAMPLE={fraction!r}: give the fraction of requests dumped, from 0 "
            f"(only those whose custom_params ask for it) to 1 (all, the default)."
        )
    seed = envs.SGLANG_HS_DUMP_SAMPLE_SEED.get()
    if not 0 <= seed < 2**64:
        raise ValueError(f"SGLANG_HS_DUMP_SAMPLE_SEED={seed}: give an integer from 0 to 2**64 - 1.")
    return RequestSample(float(fraction), seed)


@lru_cache(maxsize=1)
def dump_answers() -> bool:
    """Whether every dumped request's answer is dumped with its prompt (SGLANG_HS_DUMP_ANSWERS),
    not only those whose custom_params ask for it."""
    return envs.SGLANG_HS_DUMP_ANSWERS.get()


@lru_cache(maxsize=1)
def answer_graphs() -> bool:
    """Whether decode CUDA graphs serve the dumped answers (SGLANG_HS_DUMP_ANSWER_GRAPHS: each
    graph copies its rows where the dump takes them after a replay), rather than the decode
    steps that carry one running eagerly."""
    return envs.SGLANG_HS_DUMP_ANSWER_GRAPHS.get()


@dataclass(frozen=True)
class DumpConfig:
    dump_dir: str
    layers: Optional[str]  # SGLANG_HS_DUMP_LAYERS as given; see layer_ids
    queue_size: int
    on_full_queue: str  # "block" or "drop"
    writer_threads: int  # resolved: never 0
    drain_timeout_s: float
    dtype: Optional[str]  # None (the model's dtype), "bf16" or "fp8"
    writer_id: Optional[str] = None  # names this server's manifest in a shared directory
    host_memory_mb: int = 0  # host memory reserved for rows at startup; 0: sized from the server
    writer_process: bool = True  # files written by a process of their own (process_writer)
    sink: str = "files"  # or "mooncake": the rows go to a Mooncake store, not to files
    store_layout: str = "specforge"  # with the mooncake sink: whose layout the objects have
    store_id: str = "sglang-hs"  # with the mooncake sink: the namespace of its keys
    mooncake: Optional["MooncakeSettings"] = None  # with the mooncake sink
    sample: RequestSample = RequestSample()  # which requests that do not ask are dumped
    answers: bool = False  # every dumped request's answer too, not only those that ask
    answer_graphs: bool = False  # decode CUDA graphs serve the dumped answers

    @classmethod
    def from_env(cls) -> Optional["DumpConfig"]:
        """The settings, checked (ValueError names the variable); None when dumping is off."""
        dump_dir = envs.SGLANG_HS_DUMP_DIR.get()
        if not dump_dir:
            return None
        on_full_queue = envs.SGLANG_HS_DUMP_ON_FULL_QUEUE.get()
        if on_full_queue not in ON_FULL_QUEUE:
            raise ValueError(
                f"SGLANG_HS_DUMP_ON_FULL_QUEUE={on_full_queue!r}: use 'block' or 'drop'."
            )
        queue_size = envs.SGLANG_HS_DUMP_QUEUE_SIZE.get()
        if queue_size < 1:
            raise ValueError("SGLANG_HS_DUMP_QUEUE_SIZE must be at least 1.")
        writer_threads = envs.SGLANG_HS_DUMP_WRITER_THREADS.get()
        if writer_threads < 0:
            raise ValueError(
                "SGLANG_HS_DUMP_WRITER_THREADS must not be negative (0: from the host's cores)."
            )
        host_memory_mb = envs.SGLANG_HS_DUMP_HOST_MEMORY_MB.get()
        if host_memory_mb < 0:
            raise ValueError(
                "SGLANG_HS_DUMP_HOST_MEMORY_MB must not be negative (0: sized from the "
                "server's largest prefill)."
            )
        drain_timeout_s = envs.SGLANG_HS_DUMP_DRAIN_TIMEOUT_S.get()
        if drain_timeout_s < 0:
            raise ValueError("SGLANG_HS_DUMP_DRAIN_TIMEOUT_S must not be negative.")
        writer_process = envs.SGLANG_HS_DUMP_WRITER_PROCESS.get()
        dtype = parse_dtype(envs.SGLANG_HS_DUMP_DTYPE.get())
        sink = envs.SGLANG_HS_DUMP_SINK.get()
        if sink not in SINKS:
            raise ValueError(f"SGLANG_HS_DUMP_SINK={sink!r}: use one of {', '.join(SINKS)}.")
        store_layout = envs.SGLANG_HS_DUMP_SINK_LAYOUT.get()
        if store_layout not in STORE_LAYOUTS:
            raise ValueError(
                f"SGLANG_HS_DUMP_SINK_LAYOUT={store_layout!r}: use one of {', '.join(STORE_LAYOUTS)}."
            )
        store_id = envs.SGLANG_HS_DUMP_STORE_ID.get()
        mooncake = None
        if sink == "mooncake":
            check_store_settings(store_layout, store_id, dtype, writer_process)
            mooncake = MooncakeSettings.from_env()
        return cls(
            dump_dir=dump_dir,
            layers=envs.SGLANG_HS_DUMP_LAYERS.get(),
            queue_size=queue_size,
            on_full_queue=on_full_queue,
            writer_threads=writer_threads or default_writer_threads(writer_process),
            drain_timeout_s=drain_timeout_s,
            dtype=dtype,
            writer_id=parse_writer_id(envs.SGLANG_HS_DUMP_WRITER_ID.get()),
            host_memory_mb=host_memory_mb,
            writer_process=writer_process,
            sink=sink,
            store_layout=store_layout,
            store_id=store_id,
            mooncake=mooncake,
            sample=request_sample(),
            answers=dump_answers(),
            answer_graphs=answer_graphs(),
        )

    def layer_ids(self, num_layers: int) -> List[int]:
        return parse_layer_ids(self.layers, num_layers)


def check_store_settings(store_layout: str, store_id: str, dtype: Optional[str], writer_process: bool) -> None:
    if not store_id or "/" in store_id or not store_id.isprintable() or len(store_id) > MAX_WRITER_ID_LENGTH:
        raise ValueError(
            f"SGLANG_HS_DUMP_STORE_ID={store_id!r}: give a printable name of at most "
            f"{MAX_WRITER_ID_LENGTH} characters without '/' (the first part of every key)."
        )
    if store_layout == "specforge" and dtype == "fp8":
        raise ValueError(
            "SGLANG_HS_DUMP_DTYPE=fp8 with SGLANG_HS_DUMP_SINK_LAYOUT=specforge: SpecForge's "
            "layout has no place for fp8 scales and its reader allocates no fp8 tensors; use "
            "bf16, or the hs-connectors layout, which keeps the scales."
        )
    if not writer_process:
        raise ValueError(
            "SGLANG_HS_DUMP_WRITER_PROCESS=0 with SGLANG_HS_DUMP_SINK=mooncake: the Mooncake "
            "sink puts from the writer process; leave SGLANG_HS_DUMP_WRITER_PROCESS unset."
        )


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


def parse_writer_id(value: Optional[str]) -> Optional[str]:
    """SGLANG_HS_DUMP_WRITER_ID: None (unset), else a name for this server's manifest,
    manifest-<name>.jsonl, so that many servers dump into one directory."""
    if value is None:
        return None
    problem = (
        "is empty" if not value
        else "has a path separator" if "/" in value or "\\" in value
        else f"is {len(value)} characters long (at most {MAX_WRITER_ID_LENGTH})" if len(value) > MAX_WRITER_ID_LENGTH
        else "ends like a data-parallel rank (dp<k>)" if DP_RANK_SUFFIX.search(value)
        else "has a character that is not printable" if not value.isprintable()
        else None
    )
    if problem:
        raise ValueError(
            f"SGLANG_HS_DUMP_WRITER_ID={value!r} {problem}: give each server dumping into the "
            f"directory its own name (e.g. its host name), or leave it unset."
        )
    return value


def default_writer_threads(writer_process: bool = True) -> int:
    """Writer threads when SGLANG_HS_DUMP_WRITER_THREADS is 0: half the host's cores in a
    writer process, a quarter in the scheduler's own (where each takes the interpreter lock
    from the scheduler thread at every system call); 4 to 16 either way. In a writer
    process at a 9 GB/s prefill, 8 threads landed what 4 could not (BENCHMARKS.md, "The
    writer process")."""
    share = 2 if writer_process else 4
    return max(4, min(16, (os.cpu_count() or 4) // share))


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
