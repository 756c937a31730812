"""The dump's format on disk and in the log: what the server writes, and the reader of it.

One safetensors file per request:

    token_ids          int64 [T]
    hidden_states      [T, K, H] in the model dtype: the residual stream entering each
                       configured layer, in the configured order (transformers'
                       `hidden_states` convention: 0 is the embedding output, L the last
                       layer's output before the final norm)
    last_hidden_state  [T, H]: the final normed state the LM head reads

With the fp8 encoding both state tensors are float8 e4m3, each row scaled by its own
amax (hidden_states_scale [T, K] and last_hidden_state_scale [T], float32). The
metadata's `encoding` says which; load_dump dequantizes by default.

Each writer appends one line per complete file to its own manifest in the directory
(manifest.jsonl, or manifest-dp<k>.jsonl for data-parallel rank k > 0); read_manifest
and ManifestFollower read them all as one. A line carries the checksum of its file's bytes
("checksum": "xxh3_128:<hex>", absent in dumps written before checksums) and how many of
its rows hold NaN or infinity ("nonfinite_rows"); load_dump checks the first,
nonfinite_rows reads the second.

This module imports nothing from sglang: a trainer's machine reads a dump with torch and
safetensors alone (load this file by its path where SGLang is not installed), and checks
it with xxhash.
"""

import json
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple

import torch

FORMAT_VERSION = "1"
# A writer's manifest: manifest[-<writer id>][-dp<k>].jsonl (k > 0: a data-parallel rank).
MANIFEST_NAME = "manifest.jsonl"
MANIFEST_FILE = re.compile(r"^manifest(?:-(?!dp[0-9]+\.jsonl$)(.+?))?(?:-dp([1-9][0-9]*))?\.jsonl$")
TEMP_PREFIX = ".partial-"
# What a client and a dumping server exchange beside the prompt: the key of a request's
# sampling_params.custom_params that gives its prompt's loss mask, run-length encoded (zeros,
# ones, zeros, ...), for the sinks whose layout holds one; and the key of a dumped request's
# /generate meta_info that says, in its last output, where its sample is (a list holding one
# entry: SGLang's per-request customized_info reaches meta_info as a list).
LOSS_MASK_PARAM = "hidden_states_dump_loss_mask"
META_INFO_KEY = "hidden_states_dump"
# Keys of a request's custom_params that say whether it is dumped: DUMP_PARAM true, a request
# dumped whatever share of requests the server samples; DUMP_PARAM false, a request the
# dumping server still serves without dumping it (an answer a client has the target write);
# PRIVATE_PARAM true, a request that is never dumped, whatever else is set.
DUMP_PARAM = "hidden_states_dump"
PRIVATE_PARAM = "private"
# The key of a dumped request's custom_params that asks for its answer too: one sample of the
# prompt's rows and the rows of every token the server decodes after it (a server dumps every
# dumped request's answer under SGLANG_HS_DUMP_ANSWERS). The manifest field counts those rows.
ANSWER_PARAM = "hidden_states_dump_answer"
ANSWER_TOKENS_FIELD = "answer_tokens"
# The metadata key and manifest field of a server's request sample ({"fraction", "seed"}).
REQUEST_SAMPLE_FIELD = "request_sample"
# What a layer id means, in every file's metadata and every manifest line.
LAYER_CONVENTION = (
    "id i: the residual stream entering decoder layer i (0: the embedding output; "
    "L = num_layers: the last layer's output before the final norm)"
)
PLAIN_ENCODING = "plain"
FP8_ENCODING = "fp8_e4m3_row_scaled"
FP8_MAX = 448.0  # the largest float8 e4m3 (fn) value
# A manifest line's checksum of its sample ("<algorithm>:<hex digest>"; files.py computes it
# as it writes) and its count of rows that hold NaN or infinity (capture.py finds them on
# the device).
CHECKSUM_FIELD = "checksum"
NONFINITE_FIELD = "nonfinite_rows"
READ_BLOCK_BYTES = 16 << 20

# The tensors of a file, in file order (the scales only in fp8 files).
FILE_TENSORS = (
    "token_ids",
    "hidden_states",
    "last_hidden_state",
    "hidden_states_scale",
    "last_hidden_state_scale",
)

SAFETENSORS_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int64: "I64",
}


def file_metadata(
    layer_ids: List[int],
    num_layers: int,
    model_path: str,
    sglang_version: str,
    series_version: str,
    fp8: bool = False,
    model_dtype: torch.dtype = torch.bfloat16,
    eagle3_draft_layer_ids: Optional[List[Optional[List[int]]]] = None,
    vocab_size: Optional[int] = None,
    request_sample: Optional[dict] = None,
) -> Dict[str, str]:
    """The metadata every file of a dump carries (the writer adds each file's rid).
    `eagle3_draft_layer_ids`: each EAGLE-3 draft config (its
    eagle_aux_hidden_state_layer_ids, or None: it names none) that this SGLang release
    feeds exactly the dumped layers below L, in ascending order; empty when none does.
    fp8 files also name the model dtype that load_dump dequantizes to. `request_sample`:
    the fraction of requests a server samples and its seed, when it does not dump all."""
    metadata = {
        "format": FORMAT_VERSION,
        "layer_ids": json.dumps(layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "eagle3_draft_layer_ids": json.dumps(eagle3_draft_layer_ids or []),
        "vocab_size": json.dumps(vocab_size),
        "num_layers": str(num_layers),
        "model_path": str(model_path),
        "sglang_version": sglang_version,
        "series_version": series_version,
        "encoding": FP8_ENCODING if fp8 else PLAIN_ENCODING,
    }
    if fp8:
        metadata["model_dtype"] = dtype_name(model_dtype)
    if request_sample is not None:
        metadata[REQUEST_SAMPLE_FIELD] = json.dumps(request_sample)
    return metadata


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def quantize_rows(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 rows and the float32 scale of each (its amax times 1 / FP8_MAX), over the
    last dimension; an all-zero row gets scale 1. Three passes over the rows, with one
    float32 temporary (the quotient); on a GPU the copier quantizes with fp8_rows' kernel,
    which makes the same bits in one pass."""
    low, high = torch.aminmax(rows, dim=-1)
    amax = torch.maximum(high, -low).float()
    # Times the float32 reciprocal, which is what `amax / FP8_MAX` computes on a CUDA device
    # (but not on the CPU): written out, every device makes the same scales.
    scale = torch.where(amax > 0, amax * (1 / FP8_MAX), torch.ones_like(amax))
    # In float32, as bf16 rows divided by a float32 scale promote to.
    quantized = torch.div(rows, scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return quantized, scale


# The file's tensors that fp8 quantizes, each with its scales as `<name>_scale`.
QUANTIZED_TENSORS = ("hidden_states", "last_hidden_state")


def quantize_file_rows(rows: Dict[str, torch.Tensor], quantize=None) -> Dict[str, torch.Tensor]:
    """A forward's rows in the file's fp8 form: each state tensor quantized, with its scales
    (by `quantize`, when given: a function with quantize_rows's results)."""
    quantize = quantize or quantize_rows
    quantized = dict(rows)
    for name in QUANTIZED_TENSORS:
        quantized[name], quantized[f"{name}_scale"] = quantize(rows[name])
    return quantized


def quantized_file_rows_like(rows: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Tensors without storage (the meta device) shaped and typed as quantize_file_rows(rows)
    makes them: what the host rows are laid out by before anything is quantized."""
    layout = dict(rows)
    for name in QUANTIZED_TENSORS:
        shape = rows[name].shape
        layout[name] = torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta")
        layout[f"{name}_scale"] = torch.empty(shape[:-1], dtype=torch.float32, device="meta")
    return layout


def dequantize_rows(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (quantized.float() * scale.unsqueeze(-1)).to(dtype)


def safetensors_header(
    parts: Dict[str, List[torch.Tensor]], num_tokens: int, metadata: Dict[str, str]
) -> bytes:
    """The safetensors header of a file whose tensors are the row-wise concatenation of
    `parts`, stored back to back in that order. Metadata values must have a UTF-8 form
    (a lone surrogate in a rid fails here, before anything is written)."""
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensors in parts.items():
        first = tensors[0]
        size = first.element_size() * num_tokens * math.prod(first.shape[1:])
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[first.dtype],
            "shape": [num_tokens, *first.shape[1:]],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order (little-endian hosts), without a copy when
    it is contiguous."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def manifest_entry(
    rid: str,
    file: str,
    num_tokens: int,
    metadata: Dict[str, str],
    hidden_states: torch.Tensor,
    nonfinite_rows: int = 0,
    asked: bool = False,
    answer_tokens: Optional[int] = None,
) -> dict:
    """The manifest line of one file (read back by read_manifest); the writer adds the
    checksum of the file's bytes as it writes them. A server that samples its requests
    records its fraction and seed in every line, and whether the request asked; a sample
    that holds its request's answer, how many of its rows are the answer's."""
    entry = {
        "rid": rid,
        "file": file,
        "num_tokens": num_tokens,
        "layers": json.loads(metadata["layer_ids"]),
        "hidden_size": hidden_states.shape[-1],
        "dtype": dtype_name(hidden_states.dtype),
        "layer_convention": metadata.get("layer_convention", LAYER_CONVENTION),
        "eagle3_draft_layer_ids": json.loads(metadata.get("eagle3_draft_layer_ids", "[]")),
        NONFINITE_FIELD: nonfinite_rows,
    }
    if REQUEST_SAMPLE_FIELD in metadata:
        entry.update({REQUEST_SAMPLE_FIELD: json.loads(metadata[REQUEST_SAMPLE_FIELD]), "asked": asked})
    if answer_tokens is not None:
        entry[ANSWER_TOKENS_FIELD] = answer_tokens
    return entry


def nonfinite_rows(entry: dict) -> int:
    """How many of a sample's rows hold NaN or infinity (0 in lines written before the dump
    counted them)."""
    return entry.get(NONFINITE_FIELD, 0)


class ChecksumMismatch(ValueError):
    """A sample's bytes are not those its manifest line's checksum was taken of."""


def new_checksum(algorithm: str):
    """A running hash of `algorithm` as a checksum names it."""
    import xxhash

    if algorithm != "xxh3_128":
        raise ValueError(f"unknown checksum algorithm {algorithm!r}")
    return xxhash.xxh3_128()


def checksum_of(buffers, algorithm: str = "xxh3_128") -> str:
    """The checksum ("<algorithm>:<hex>") of `buffers`' bytes, back to back."""
    running = new_checksum(algorithm)
    for buffer in buffers:
        running.update(buffer)
    return f"{algorithm}:{running.hexdigest()}"


def check_checksum(name: str, expected: Optional[str], buffers) -> None:
    """Raise ChecksumMismatch, naming `name`, when `buffers` do not hash to `expected` (None:
    a line written before checksums, nothing to check)."""
    if expected is None:
        return
    actual = checksum_of(buffers, expected.split(":", 1)[0])
    if actual != expected:
        raise ChecksumMismatch(
            f"{name}: its bytes changed since they were written (checksum {actual}, its manifest line says {expected})"
        )


def file_checksum(path: str, expected: str, progress=None) -> str:
    """The checksum of a file's bytes with `expected`'s algorithm, read in blocks;
    `progress(bytes)` is called after each."""
    running = new_checksum(expected.split(":", 1)[0])
    block = bytearray(READ_BLOCK_BYTES)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while True:
            size = f.readinto(block)
            if not size:
                break
            running.update(view[:size])
            if progress is not None:
                progress(size)
    return f"{expected.split(':', 1)[0]}:{running.hexdigest()}"


def manifest_name(dp_rank: int, writer_id: Optional[str] = None) -> str:
    """The manifest of one writer: named by the server's writer id (SGLANG_HS_DUMP_WRITER_ID)
    when it has one, and by its data-parallel rank when that is not 0."""
    name = "manifest" + (f"-{writer_id}" if writer_id else "")
    return name + (f"-dp{dp_rank}" if dp_rank else "") + ".jsonl"


def manifest_paths(dump_dir: str) -> List[str]:
    """Every writer's manifest in `dump_dir`: the unnamed writers' first, then by writer
    id; each writer's data-parallel ranks in order."""
    try:
        names = os.listdir(dump_dir)
    except FileNotFoundError:
        return []
    ranked = [
        (m.group(1) is not None, m.group(1) or "", int(m.group(2) or 0), name)
        for name in names
        if (m := MANIFEST_FILE.match(name))
    ]
    return [os.path.join(dump_dir, key[-1]) for key in sorted(ranked)]


def parse_manifest_line(line: bytes) -> Optional[dict]:
    """A manifest entry, or None when `line` is not one (a torn line)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def sample_name(entry: dict) -> str:
    """A sample's name in a manifest line or in the location a response reports
    (META_INFO_KEY): its id in a store, or its file."""
    return entry["sample_id"] if "sample_id" in entry else entry["file"]


def read_manifest(dump_dir: str) -> List[dict]:
    """The entries of every writer's manifest in `dump_dir`, each manifest in its order
    (see manifest_paths). A torn last line (a line being appended, or one a killed server
    left) is not an entry; a line that does not parse elsewhere is an error."""
    return ManifestFollower(dump_dir).poll()


class ManifestFollower:
    """Follows every manifest of a dump directory as writers append to them: each `poll`
    returns the entries added since the last one, reading only the bytes appended since
    (a manifest that appears later is picked up). A torn last line waits for its end."""

    def __init__(self, dump_dir: str):
        self.dump_dir = str(dump_dir)
        self._offsets: Dict[str, int] = {}  # manifest path: bytes consumed (whole lines)
        self._line_numbers: Dict[str, int] = {}
        self.entries: List[dict] = []  # every entry seen so far

    def poll(self) -> List[dict]:
        new = []
        for path in manifest_paths(self.dump_dir):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                self._line_numbers[path] = self._line_numbers.get(path, 0) + 1
                if not line.strip():
                    continue
                entry = parse_manifest_line(line)
                if entry is None:
                    raise ValueError(
                        f"{path}:{self._line_numbers[path]}: not a manifest entry: {line[:200]!r}"
                    )
                new.append(entry)
            self._offsets[path] = offset + end
        self.entries += new
        return new


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
    def eagle3_draft_layer_ids(self) -> List[Optional[List[int]]]:
        """See file_metadata (empty in files written before the dump recorded it)."""
        return json.loads(self.metadata.get("eagle3_draft_layer_ids", "[]"))

    @property
    def vocab_size(self) -> Optional[int]:
        """The model's vocabulary size (None in files written before the dump recorded it)."""
        return json.loads(self.metadata.get("vocab_size", "null"))

    @property
    def num_layers(self) -> int:
        return int(self.metadata["num_layers"])

    @property
    def encoding(self) -> str:
        return self.metadata.get("encoding", PLAIN_ENCODING)


def load_dump(path: str, raw: bool = False, checksum: Optional[str] = None) -> DumpRecord:
    """Read one dumped file: the writer's twin, used by tests and tools. fp8 states come
    back dequantized to the model's dtype, or as stored (with their scales) when `raw`.
    With `checksum` (its manifest line's), the bytes read are checked against it first:
    ChecksumMismatch names the file."""
    if checksum is None:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            metadata = f.metadata()
    else:
        from safetensors.torch import load

        with open(path, "rb") as f:
            data = f.read()
        check_checksum(os.path.basename(path), checksum, [data])
        tensors = load(data)
        header_size = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_size]).get("__metadata__", {})
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


class LogLine:
    """A dataclass of integers that operators read in the server log, as the line `line`
    builds after LOG_PREFIX; `parse` reads the last such line of a log back."""

    LOG_PREFIX = ""

    def line(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, log: str):
        """The values of the last such line in `log` (None: there is none)."""
        pattern = re.escape(cls.LOG_PREFIX) + " ".join(rf"{f.name}=(\d+)" for f in fields(cls))
        matches = re.findall(pattern, log)
        return cls(*map(int, matches[-1])) if matches else None


@dataclass(frozen=True)
class DumpCounters(LogLine):
    """A snapshot of the dump's counters."""

    LOG_PREFIX = "hidden states dump: "

    files: int = 0
    tokens: int = 0
    bytes: int = 0
    errors: int = 0
    dropped: int = 0
    discarded: int = 0
    host_overflows: int = 0  # forwards whose rows found no room in the host reserve
    store_full: int = 0  # samples that waited for room in a full Mooncake store
    nonfinite: int = 0  # samples with rows that hold NaN or infinity (flagged in the manifest)


@dataclass(frozen=True)
class DumpTimings(LogLine):
    """Where the dump's time went, in milliseconds summed since the start: on the
    scheduler thread, taking rows off the forward (`capture_ms`) and waiting for a full
    queue (`blocked_ms`); on the writer threads, waiting for rows to reach the host
    (`copy_wait_ms`), writing and syncing files (`write_ms`), and publishing them in
    submission order, renaming each and appending its manifest line (`manifest_ms`)."""

    LOG_PREFIX = "hidden states dump timings: "

    capture_ms: int = 0
    blocked_ms: int = 0
    copy_wait_ms: int = 0
    write_ms: int = 0
    manifest_ms: int = 0
