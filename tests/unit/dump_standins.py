"""Stand-ins the dump module's unit tests share: a model whose every row says which token
and which layer it belongs to, a forward batch, a scheduler's request, and ways to wait for
and check the files.

Row values are `token_id * 1000 + layer_id * 10 + column`, and the final normed state is
its negative. Token ids are distinct across all prompts of a test, so a row taken from the
wrong request or position cannot match.
"""

import json
import os
import re
import time
from dataclasses import asdict
from types import SimpleNamespace
from unittest import mock
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper, layers_captured_in
from sglang.srt.hidden_states_dump.config import DumpConfig
from sglang.srt.hidden_states_dump.format import (
    CHECKSUM_FIELD,
    MANIFEST_NAME,
    META_INFO_KEY,
    checksum_of,
    file_metadata,
    load_dump,
    read_manifest,
)
from sglang.srt.hidden_states_dump.requests import DumpRequest
from sglang.srt.model_executor.forward_batch_info import ForwardMode

HIDDEN_SIZE = 3
NUM_LAYERS = 4
WAIT_TIMEOUT_S = 30.0
FILE_NAME = re.compile(r"^\d{8}T\d{6}-[0-9a-f]{8}-\d{9}\.safetensors$")


def layer_rows(token_ids: Sequence[int], layer_id: int) -> torch.Tensor:
    """The stand-in model's residual stream entering `layer_id`, one row per token."""
    tokens = torch.tensor(token_ids, dtype=torch.float32)[:, None]
    return tokens * 1000 + layer_id * 10 + torch.arange(HIDDEN_SIZE)


def final_rows(token_ids: Sequence[int]) -> torch.Tensor:
    """The stand-in model's final normed hidden states."""
    return -layer_rows(token_ids, 0)


def dump_config(dump_dir, dtype=None, writer_process: bool = True) -> DumpConfig:
    """The settings as the server reads them from its environment (the test's), dumping
    into `dump_dir` with SGLANG_HS_DUMP_DTYPE=`dtype`; `writer_process` False: the files
    are written by threads of the test's own process (where a test injects faults)."""
    with mock.patch.dict(os.environ, {"SGLANG_HS_DUMP_DIR": str(dump_dir), "SGLANG_HS_DUMP_DTYPE": dtype or "",
                                      "SGLANG_HS_DUMP_WRITER_PROCESS": str(int(writer_process))}):
        return DumpConfig.from_env()


def stand_in_metadata(layer_ids: List[int], dtype=None) -> dict:
    return file_metadata(layer_ids, NUM_LAYERS, "/models/stand-in", sglang_version="stand-in",
                         series_version="stand-in", fp8=dtype == "fp8", model_dtype=torch.float32)


RESERVE_BYTES = 1 << 20  # host memory the stand-in dumper reserves for rows


class SchedulerReq:
    """A scheduler Req as the dump's hooks read it, hashed and weakly referenced by identity
    as a Req is (the dump keeps the requests answering, and where their samples are, by it)."""

    def __init__(self, rid, origin_input_ids=(5, 6, 7), output_ids=(), custom_params=None, retraction_count=0,
                 stream=False, max_new_tokens=128):
        self.rid, self.stream = rid, stream
        self.origin_input_ids, self.output_ids = list(origin_input_ids), list(output_ids)
        self.sampling_params = SimpleNamespace(custom_params=custom_params, max_new_tokens=max_new_tokens)
        self.to_finish, self.finished_reason, self.retraction_count = None, None, retraction_count
        self.customized_info = None
        self.send_token_offset = 0  # output tokens sent before the next output

    def finish(self, how: str = "length") -> "SchedulerReq":
        self.finished_reason = SimpleNamespace(to_json=lambda: {"type": how})
        return self

    def finished(self) -> bool:
        return self.finished_reason is not None


def next_output_reports(req: SchedulerReq) -> list:
    """What the request's next output carries under META_INFO_KEY: SGLang's scheduler sends
    an output the customized_info values of the tokens it sends, from send_token_offset on."""
    return (req.customized_info or {}).get(META_INFO_KEY, [])[req.send_token_offset:]


def start_dumper(dump_dir, layer_ids: List[int], dp_rank: int = 0, dtype=None,
                 reserve_bytes: int = RESERVE_BYTES, writer_process: bool = True) -> HiddenStatesDumper:
    return HiddenStatesDumper(dump_config(dump_dir, dtype, writer_process), stand_in_metadata(layer_ids, dtype),
                              is_writer=True, dp_rank=dp_rank, reserve_bytes=reserve_bytes)


# One request of a forward: what it dumps (None: not dumped), the token ids of its rows
# in this forward, and how many of its tokens earlier forwards prefilled.
Extend = Tuple[Optional[DumpRequest], Sequence[int], int]


def run_forward(dumper: HiddenStatesDumper, batch: List[Extend]) -> None:
    """One extend forward of the stand-in model, handed to the dumper as the model
    does: aux hidden states in ascending layer order."""
    token_ids = [token for _, tokens, _ in batch for token in tokens]
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        hidden_states_dump_requests=[request for request, _, _ in batch],
        extend_prefix_lens_cpu=[prefix_len for _, _, prefix_len in batch],
        extend_seq_lens_cpu=[len(tokens) for _, tokens, _ in batch],
        input_ids=torch.tensor(token_ids, dtype=torch.int32),
    )
    captured = layers_captured_in(forward_batch, dumper.layer_ids)
    aux = [layer_rows(token_ids, layer_id) for layer_id in sorted(captured)]
    dumper.capture(forward_batch, final_rows(token_ids), aux)


def run_decode(dumper: HiddenStatesDumper, token_ids: Sequence[int],
               requests: Sequence[Optional[DumpRequest]] = (), positions: Sequence[int] = ()) -> None:
    """A decode forward of one token a request, at `positions`: the scheduler attaches a dump
    request only to the requests whose answer is dumped (`requests`, None for the others);
    without one, the model captures no layers."""
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        hidden_states_dump_requests=list(requests) if any(requests) else [],
        seq_lens_cpu=torch.tensor(positions, dtype=torch.int64) + 1 if positions else None,
        extend_prefix_lens_cpu=None,
        extend_seq_lens_cpu=None,
        input_ids=torch.tensor(token_ids, dtype=torch.int32),
    )
    captured = layers_captured_in(forward_batch, dumper.layer_ids)
    assert bool(captured) == any(requests)
    aux = [layer_rows(token_ids, layer_id) for layer_id in sorted(captured)]
    dumper.capture(forward_batch, final_rows(token_ids), aux)


def stats(dumper: HiddenStatesDumper) -> Dict[str, int]:
    return asdict(dumper.counters())


def wait_for_manifest(dump_dir, rids, timeout=WAIT_TIMEOUT_S) -> List[dict]:
    """Poll the manifest until it names every rid in `rids`; on each poll, check that
    every line names a complete file."""
    deadline = time.monotonic() + timeout
    while True:
        lines = read_manifest(str(dump_dir))
        for line in lines:
            load_dump(os.path.join(dump_dir, line["file"]))
        if set(rids) <= {line["rid"] for line in lines}:
            return lines
        if time.monotonic() > deadline:
            raise AssertionError(
                f"after {timeout}s the manifest names {[line['rid'] for line in lines]}, "
                f"not all of {list(rids)}"
            )
        time.sleep(0.01)


_sentinel_token = iter(range(900_000, 1_000_000))


def wait_for_writer(dumper: HiddenStatesDumper, dump_dir) -> List[dict]:
    """Everything submitted so far is on disk or failed: manifest lines follow the
    submission order, so once a request dumped now appears, earlier ones are done.
    Returns the manifest without that request."""
    token = next(_sentinel_token)
    rid = f"sentinel-{token}"
    run_forward(dumper, [(DumpRequest(rid, 1), [token], 0)])
    lines = wait_for_manifest(dump_dir, [rid])
    return [line for line in lines if not line["rid"].startswith("sentinel-")]


def assert_dumped(dump_dir, line, token_ids, layer_ids) -> None:
    """The file of manifest line `line` holds exactly the prompt `token_ids`, and the line
    the checksum of its bytes."""
    path = os.path.join(dump_dir, line["file"])
    with open(path, "rb") as f:
        assert line[CHECKSUM_FIELD] == checksum_of([f.read()])
    assert line["nonfinite_rows"] == 0
    record = load_dump(path, checksum=line[CHECKSUM_FIELD])
    expected_layers = torch.stack(
        [layer_rows(token_ids, layer_id) for layer_id in layer_ids], dim=1
    )
    assert record.token_ids.dtype == torch.int64
    assert record.token_ids.tolist() == list(token_ids)
    assert torch.equal(record.hidden_states, expected_layers)
    assert torch.equal(record.last_hidden_state, final_rows(token_ids))
    assert record.layer_ids == layer_ids
    assert record.metadata["rid"] == line["rid"]
    assert line["num_tokens"] == len(token_ids)
    assert line["layers"] == layer_ids
    assert line["hidden_size"] == HIDDEN_SIZE
    assert line["dtype"] == "float32"


def assert_dir_holds_exactly(dump_dir, lines, manifests=(MANIFEST_NAME,)) -> None:
    """The dump directory holds the manifests and the files they name, nothing else (no
    temporary files)."""
    expected = [*manifests] + [line["file"] for line in lines]
    assert sorted(os.listdir(dump_dir)) == sorted(expected)
    assert all(FILE_NAME.match(line["file"]) for line in lines)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, to compare exactly: fp8 has no equality, and float32 scales are
    compared bit for bit (other dtypes as they are)."""
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8)
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor


def prompt(first_token: int, length: int) -> List[int]:
    return list(range(first_token, first_token + length))


def wait_for_stats(dumper, done, timeout=WAIT_TIMEOUT_S) -> Dict[str, int]:
    """Poll the dumper's counters until `done(counters)` holds."""
    deadline = time.monotonic() + timeout
    while not done(stats(dumper)):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s: {dumper.counters()}")
        time.sleep(0.01)
    return stats(dumper)


def wait_for_free_regions(dumper, expected, timeout=WAIT_TIMEOUT_S) -> None:
    """Poll until the dumper's host buffers have exactly the free regions `expected`: a
    writer process answers a file after its manifest line, and only then are its rows
    given back."""
    deadline = time.monotonic() + timeout
    while dumper.host_buffers.free_regions() != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s the free regions are {dumper.host_buffers.free_regions()}, "
                                 f"not {expected}")
        time.sleep(0.01)


def submit_many(dumper, count) -> List[str]:
    rids = [f"r{i}" for i in range(count)]
    for i, rid in enumerate(rids):
        run_forward(dumper, [(DumpRequest(rid, 64), prompt(1000 + 100 * i, 64), 0)])
    return rids


def manifest_lines_strictly(dump_dir) -> List[dict]:
    """Every line of the manifest, each required to be whole JSON ending in a newline
    (stricter than read_manifest, which tolerates a torn last line)."""
    data = (dump_dir / MANIFEST_NAME).read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]
