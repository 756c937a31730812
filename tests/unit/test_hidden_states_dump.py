"""sglang/srt/managers/hidden_states_dump.py (patch 0003): its configuration checks, and
the dumper end to end on the CPU, read back with the module's own reader.

The dumper is driven the way the model drives it, one `capture` per forward, with a
stand-in model whose every row says which token and which layer it belongs to: row
values are `token_id * 1000 + layer_id * 10 + column`, and the final normed state is
its negative. Token ids are distinct across all prompts of a test, so a row taken from
the wrong request or position cannot match.
"""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from sglang.srt.managers import hidden_states_dump
from sglang.srt.managers.hidden_states_dump import (
    DumpRequest,
    HiddenStatesDumper,
    check_dump_dir,
    check_server_args,
    default_layer_ids,
    load_dump,
    parse_layer_ids,
    read_manifest,
    requests_to_dump,
    wants_dump,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from tests.unit.conftest import RELEASE

HIDDEN_SIZE = 3
NUM_LAYERS = 4
WAIT_TIMEOUT_S = 30.0
FILE_NAME = re.compile(r"^\d{8}T\d{6}-[0-9a-f]{8}-\d{9}\.safetensors$")


# --- parse_layer_ids ---------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, num_layers, expected",
    [
        ("3,0,2", 4, [3, 0, 2]),
        ("0,4", 4, [0, 4]),
        ("60", 61, [60]),
        ("61,0", 61, [61, 0]),
        (" 1 , 2 ", 4, [1, 2]),
    ],
)
def test_parse_layer_ids_keeps_the_given_order(spec, num_layers, expected):
    assert parse_layer_ids(spec, num_layers) == expected


def test_parse_layer_ids_unset_gives_the_default():
    assert parse_layer_ids(None, 61) == [3, 31, 59]


@pytest.mark.parametrize(
    "spec",
    [
        "5",  # beyond L
        "0,62",
        "-1",
        "1,2,1",  # duplicate
        "3,3",
        "",  # empty
        "   ",
        "a",  # not integers
        "1.5",
        "1,,2",
        "1;2",
        "[1, 2]",
    ],
)
def test_parse_layer_ids_refuses_with_the_valid_range(spec):
    num_layers = 61 if "62" in spec else 4
    with pytest.raises(ValueError) as error:
        parse_layer_ids(spec, num_layers)
    message = str(error.value)
    assert f"L={num_layers}" in message
    assert f"0..{num_layers}" in message


# --- default_layer_ids -------------------------------------------------------------


def test_default_layer_ids_are_eagle3s():
    assert default_layer_ids(61) == [3, 31, 59]


@pytest.mark.parametrize("num_layers", range(1, 9))
def test_default_layer_ids_of_shallow_models_are_valid(num_layers):
    ids = default_layer_ids(num_layers)

    assert ids == sorted(set(ids))
    assert all(0 <= i <= num_layers for i in ids)
    assert parse_layer_ids(",".join(map(str, ids)), num_layers) == ids


# --- wants_dump / requests_to_dump -------------------------------------------------


def make_req(rid, prompt=(1, 2, 3), output_ids=()):
    # Imported here, not at the top: schedule_batch takes seconds to import, which the
    # child process of the full-disk test would pay for nothing.
    from sglang.srt.managers.schedule_batch import Req

    req = Req(rid, "", list(prompt), SamplingParams(max_new_tokens=4))
    req.output_ids.extend(output_ids)
    return req


@pytest.mark.parametrize(
    "rid, output_ids, dumped",
    [
        ("client-1", (), True),
        ("WARMUP_1700000000.0", (), False),
        ("HEALTH_CHECK_1700000000", (), False),
        ("HEALTH_CHECK", (), False),
        ("x-WARMUP_1", (), True),  # only a prefix marks the server's own requests
        ("warmup_1", (), True),
        # A retracted request prefills again, with the tokens it had generated.
        ("client-2", (7, 8), False),
    ],
)
def test_wants_dump(rid, output_ids, dumped):
    assert wants_dump(make_req(rid, output_ids=output_ids)) is dumped


def test_an_aborted_request_is_not_dumped():
    # An abort takes effect only after the prefill it arrived during.
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req = make_req("client-1")
    req.to_finish = FINISH_ABORT("client went away")

    assert not wants_dump(req)


def test_a_finished_request_is_not_dumped():
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    req = make_req("client-1")
    req.finished_reason = FINISH_LENGTH(length=0)

    assert not wants_dump(req)


def test_requests_to_dump_follows_the_batch_order():
    reqs = [
        make_req("a", prompt=(1, 2, 3, 4)),
        make_req("WARMUP_1"),
        make_req("b", prompt=(5,)),
        make_req("c", output_ids=(9,)),
        make_req("HEALTH_CHECK_2"),
    ]

    assert requests_to_dump(reqs) == [
        DumpRequest("a", 4),
        None,
        DumpRequest("b", 1),
        None,
        None,
    ]


# --- check_dump_dir / check_server_args --------------------------------------------


def test_check_dump_dir_creates_a_missing_directory(tmp_path):
    dump_dir = tmp_path / "a" / "b"
    check_dump_dir(str(dump_dir))

    assert dump_dir.is_dir()
    assert list(dump_dir.iterdir()) == []


def test_check_dump_dir_refuses_a_path_below_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a writable directory"):
        check_dump_dir(str(tmp_path / "file" / "dump"))


def test_check_dump_dir_refuses_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a writable directory"):
        check_dump_dir(str(tmp_path / "file"))


def test_check_dump_dir_refuses_a_path_no_one_can_create():
    # procfs refuses new directories, also to root.
    with pytest.raises(ValueError, match="not a writable directory"):
        check_dump_dir("/proc/hidden-states-dump")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_check_dump_dir_refuses_a_read_only_directory(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not a writable directory"):
            check_dump_dir(str(tmp_path))
    finally:
        tmp_path.chmod(0o700)


def server_args(**overrides):
    plain = dict(
        pp_size=1,
        speculative_algorithm=None,
        enable_two_batch_overlap=False,
        enable_piecewise_cuda_graph=False,
    )
    return SimpleNamespace(**{**plain, **overrides})


def test_check_server_args_accepts_a_plain_config():
    check_server_args(server_args())
    check_server_args(server_args(tp_size=8, dp_size=2, enable_dp_attention=True))


# 0.5.9's piecewise CUDA graph replays prefills without the dump hook, so it is refused;
# 0.5.14 has no such flag: its prefill graphs decline batches with dumped requests.
REFUSALS = [
    (dict(pp_size=2), "--pp-size"),
    (dict(speculative_algorithm="EAGLE3"), "speculative decoding"),
    (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
] + ([(dict(enable_piecewise_cuda_graph=True), "--enable-piecewise-cuda-graph")] if RELEASE < (0, 5, 14) else [])


@pytest.mark.parametrize("overrides, named", REFUSALS)
def test_check_server_args_refuses(overrides, named):
    with pytest.raises(ValueError, match="SGLANG_HS_DUMP_DIR") as error:
        check_server_args(server_args(**overrides))
    assert named in str(error.value)


def test_check_server_args_names_every_refusal():
    with pytest.raises(ValueError) as error:
        check_server_args(server_args(**{k: v for overrides, _ in REFUSALS for k, v in overrides.items()}))
    for _, named in REFUSALS:
        assert named in str(error.value)


# --- the dumper, end to end ---------------------------------------------------------


def layer_rows(token_ids: Sequence[int], layer_id: int) -> torch.Tensor:
    """The stand-in model's residual stream entering `layer_id`, one row per token."""
    tokens = torch.tensor(token_ids, dtype=torch.float32)[:, None]
    return tokens * 1000 + layer_id * 10 + torch.arange(HIDDEN_SIZE)


def final_rows(token_ids: Sequence[int]) -> torch.Tensor:
    """The stand-in model's final normed hidden states."""
    return -layer_rows(token_ids, 0)


def start_dumper(dump_dir, layer_ids: List[int]) -> HiddenStatesDumper:
    metadata = {
        "format": hidden_states_dump.FORMAT_VERSION,
        "layer_ids": json.dumps(layer_ids),
        "num_layers": str(NUM_LAYERS),
        "model_path": "/models/stand-in",
        "sglang_version": "0.5.9",
        "series_version": hidden_states_dump.SERIES_VERSION,
    }
    return HiddenStatesDumper(str(dump_dir), layer_ids, is_writer=True, metadata=metadata)


# One request of a forward: what it dumps (None: not dumped), the token ids of its rows
# in this forward, and how many of its tokens earlier forwards prefilled.
Extend = Tuple[Optional[DumpRequest], Sequence[int], int]


def run_forward(dumper: HiddenStatesDumper, batch: List[Extend]) -> None:
    """One extend forward of the stand-in model, handed to the dumper as the model
    does: aux hidden states in ascending layer order."""
    token_ids = [token for _, tokens, _ in batch for token in tokens]
    forward_batch = SimpleNamespace(
        hidden_states_dump_requests=[request for request, _, _ in batch],
        extend_prefix_lens_cpu=[prefix_len for _, _, prefix_len in batch],
        extend_seq_lens_cpu=[len(tokens) for _, tokens, _ in batch],
        input_ids=torch.tensor(token_ids, dtype=torch.int32),
    )
    aux = [layer_rows(token_ids, layer_id) for layer_id in sorted(dumper.layer_ids)]
    dumper.capture(forward_batch, final_rows(token_ids), aux)


def run_decode(dumper: HiddenStatesDumper, token_ids: Sequence[int]) -> None:
    """A decode forward: the scheduler attaches no dump requests to it."""
    forward_batch = SimpleNamespace(
        hidden_states_dump_requests=None,
        extend_prefix_lens_cpu=None,
        extend_seq_lens_cpu=None,
        input_ids=torch.tensor(token_ids, dtype=torch.int32),
    )
    aux = [layer_rows(token_ids, layer_id) for layer_id in sorted(dumper.layer_ids)]
    dumper.capture(forward_batch, final_rows(token_ids), aux)


def stats(dumper: HiddenStatesDumper) -> Dict[str, int]:
    return {
        name: int(value)
        for name, value in (item.split("=") for item in dumper.stats.split())
    }


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
    """The file of manifest line `line` holds exactly the prompt `token_ids`."""
    record = load_dump(os.path.join(dump_dir, line["file"]))
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


def assert_dir_holds_exactly(dump_dir, lines) -> None:
    """The dump directory holds the manifest and the files it names, nothing else (no
    temporary files)."""
    expected = [hidden_states_dump.MANIFEST_NAME] + [line["file"] for line in lines]
    assert sorted(os.listdir(dump_dir)) == sorted(expected)
    assert all(FILE_NAME.match(line["file"]) for line in lines)


def prompt(first_token: int, length: int) -> List[int]:
    return list(range(first_token, first_token + length))


@pytest.fixture
def dump_dir(tmp_path):
    path = tmp_path / "dump"
    path.mkdir()
    return path


def test_a_batch_dumps_each_requested_prompt(dump_dir):
    layer_ids = [0, 2, 4]
    dumper = start_dumper(dump_dir, layer_ids)
    a, b, c, d, e = prompt(100, 4), prompt(200, 3), prompt(300, 2), prompt(400, 1), prompt(500, 5)

    run_forward(
        dumper,
        [
            (DumpRequest("a", 4), a, 0),
            (None, b, 0),
            (DumpRequest("c", 2), c, 0),
            (None, d, 0),
            (DumpRequest("e", 5), e, 0),
        ],
    )
    lines = wait_for_manifest(dump_dir, ["a", "c", "e"])

    assert sorted(line["rid"] for line in lines) == ["a", "c", "e"]
    by_rid = {line["rid"]: line for line in lines}
    for rid, tokens in (("a", a), ("c", c), ("e", e)):
        assert_dumped(dump_dir, by_rid[rid], tokens, layer_ids)
    assert_dir_holds_exactly(dump_dir, lines)
    # A writer counts its file just after appending its manifest line.
    counters = wait_for_stats(dumper, lambda c: c["files"] == 3)
    assert counters["tokens"] == 11


def test_a_batch_of_one_request(dump_dir):
    dumper = start_dumper(dump_dir, [1])
    tokens = prompt(100, 6)

    run_forward(dumper, [(DumpRequest("only", 6), tokens, 0)])
    (line,) = wait_for_manifest(dump_dir, ["only"])

    assert_dumped(dump_dir, line, tokens, [1])


def test_the_configured_layer_order_is_kept(dump_dir):
    layer_ids = [3, 0, 2]
    dumper = start_dumper(dump_dir, layer_ids)
    tokens = prompt(100, 3)

    run_forward(dumper, [(DumpRequest("r", 3), tokens, 0)])
    (line,) = wait_for_manifest(dump_dir, ["r"])

    record = load_dump(os.path.join(dump_dir, line["file"]))
    for k, layer_id in enumerate(layer_ids):
        assert torch.equal(record.hidden_states[:, k], layer_rows(tokens, layer_id))
    assert_dumped(dump_dir, line, tokens, layer_ids)


def test_a_chunked_prefill_is_stitched_into_one_file(dump_dir):
    layer_ids = [1, 3]
    dumper = start_dumper(dump_dir, layer_ids)
    long, other, late = prompt(100, 10), prompt(200, 2), prompt(300, 5)
    request = DumpRequest("long", 10)

    run_forward(dumper, [(request, long[0:4], 0)])
    run_decode(dumper, [900, 901])
    run_forward(dumper, [(request, long[4:8], 4), (DumpRequest("other", 2), other, 0)])
    # "other" is written after the second chunk: "long" is not, it is incomplete.
    lines = wait_for_manifest(dump_dir, ["other"])
    assert [line["rid"] for line in lines] == ["other"]

    run_forward(dumper, [(request, long[8:10], 8), (DumpRequest("late", 5), late[0:3], 0)])
    run_forward(dumper, [(DumpRequest("late", 5), late[3:5], 3)])
    lines = wait_for_manifest(dump_dir, ["other", "long", "late"])

    by_rid = {line["rid"]: line for line in lines}
    assert len(lines) == 3
    assert_dumped(dump_dir, by_rid["long"], long, layer_ids)
    assert_dumped(dump_dir, by_rid["late"], late, layer_ids)
    assert_dumped(dump_dir, by_rid["other"], other, layer_ids)
    assert_dir_holds_exactly(dump_dir, lines)
    assert stats(dumper)["errors"] == stats(dumper)["discarded"] == 0


def test_a_request_that_leaves_mid_chunking_is_discarded(dump_dir):
    dumper = start_dumper(dump_dir, [2])
    gone, other = prompt(100, 10), prompt(200, 3)

    run_forward(dumper, [(DumpRequest("gone", 10), gone[0:4], 0)])
    run_forward(dumper, [(DumpRequest("other", 3), other, 0)])

    assert stats(dumper)["discarded"] == 1
    lines = wait_for_writer(dumper, dump_dir)
    assert [line["rid"] for line in lines] == ["other"]
    # Its next chunk, were it to come back, has nothing to be stitched to.
    run_forward(dumper, [(DumpRequest("gone", 10), gone[4:10], 4)])
    assert stats(dumper)["errors"] == 1
    assert [line["rid"] for line in wait_for_writer(dumper, dump_dir)] == ["other"]


def test_a_request_no_longer_dumped_mid_chunking_is_discarded(dump_dir):
    # Aborted between two chunks: still in the batch, but no longer dumped.
    dumper = start_dumper(dump_dir, [2])
    tokens = prompt(100, 8)

    run_forward(dumper, [(DumpRequest("aborted", 8), tokens[0:4], 0)])
    run_forward(dumper, [(None, tokens[4:8], 4)])

    assert stats(dumper)["discarded"] == 1
    assert wait_for_writer(dumper, dump_dir) == []


def test_a_chunk_without_its_start_gives_no_file(dump_dir):
    dumper = start_dumper(dump_dir, [2])
    tokens = prompt(100, 8)

    run_forward(dumper, [(DumpRequest("late", 8), tokens[4:8], 4)])

    assert stats(dumper)["errors"] == 1
    assert wait_for_writer(dumper, dump_dir) == []


def test_a_chunk_that_skips_positions_gives_no_file(dump_dir):
    dumper = start_dumper(dump_dir, [2])
    tokens = prompt(100, 9)

    run_forward(dumper, [(DumpRequest("gap", 9), tokens[0:3], 0)])
    run_forward(dumper, [(DumpRequest("gap", 9), tokens[6:9], 6)])

    assert stats(dumper)["errors"] == 1
    assert wait_for_writer(dumper, dump_dir) == []


def test_rows_beyond_the_prompt_are_not_dumped(dump_dir):
    layer_ids = [0, 4]
    dumper = start_dumper(dump_dir, layer_ids)
    mixed_prompt = prompt(100, 4)
    with_output = prompt(300, 5) + [390, 391]
    chunked = prompt(400, 6) + [490, 491]

    # A MIXED batch: a prefill next to a running request decoding its 8th token.
    run_forward(
        dumper,
        [(DumpRequest("mixed", 4), mixed_prompt, 0), (None, [299], 7)],
    )
    # An extend of a prompt and two generated tokens (what a retracted request prefills
    # again; requests_to_dump does not hand it over, the dumper must not rely on that),
    # and a chunk that runs past the end of its prompt.
    run_forward(
        dumper,
        [
            (DumpRequest("past-end", 5), with_output, 0),
            (DumpRequest("chunked", 6), chunked[0:4], 0),
        ],
    )
    run_forward(dumper, [(DumpRequest("chunked", 6), chunked[4:8], 4)])
    # A request whose prompt is done has no prompt rows left.
    run_forward(dumper, [(DumpRequest("done", 5), [599], 5)])
    lines = wait_for_writer(dumper, dump_dir)

    by_rid = {line["rid"]: line for line in lines}
    assert sorted(by_rid) == ["chunked", "mixed", "past-end"]
    assert_dumped(dump_dir, by_rid["mixed"], mixed_prompt, layer_ids)
    assert_dumped(dump_dir, by_rid["past-end"], with_output[:5], layer_ids)
    assert_dumped(dump_dir, by_rid["chunked"], chunked[:6], layer_ids)
    assert stats(dumper)["errors"] == 0


HOSTILE_RIDS = [
    "../../x",
    "../escaped.safetensors",
    "/abs/path",
    "/tmp",
    "a/b\\c",
    ".",
    "..",
    "",
    " ",
    "manifest.jsonl",
    hidden_states_dump.TEMP_PREFIX + "x",
    "r" * 10_240,
    "nul\x00byte",
    "new\nline\r\t",
    'quote"{}[],',
    "ünïcødé-请求-🚀-\u202eRTL",
]


def test_hostile_rids_stay_data(tmp_path):
    dump_dir = tmp_path / "a" / "b" / "dump"
    dump_dir.mkdir(parents=True)
    assert not os.path.lexists("/abs/path")
    dumper = start_dumper(dump_dir, [1, 2])
    prompts = {rid: prompt(1000 + 10 * i, 3) for i, rid in enumerate(HOSTILE_RIDS)}

    run_forward(dumper, [(DumpRequest(rid, 3), prompts[rid], 0) for rid in HOSTILE_RIDS[:8]])
    for rid in HOSTILE_RIDS[8:]:
        run_forward(dumper, [(DumpRequest(rid, 3), prompts[rid][:2], 0)])
        run_forward(dumper, [(DumpRequest(rid, 3), prompts[rid][2:], 2)])
    lines = wait_for_manifest(dump_dir, HOSTILE_RIDS)

    assert sorted(line["rid"] for line in lines) == sorted(HOSTILE_RIDS)
    for line in lines:
        assert_dumped(dump_dir, line, prompts[line["rid"]], [1, 2])
    assert_dir_holds_exactly(dump_dir, lines)
    written = [
        os.path.join(root, name) for root, _, names in os.walk(tmp_path) for name in names
    ]
    assert all(os.path.dirname(path) == str(dump_dir) for path in written)
    assert not os.path.lexists("/abs/path")
    assert stats(dumper)["errors"] == 0


def test_a_rid_that_cannot_be_encoded_costs_only_its_own_file(dump_dir):
    # A lone surrogate survives json.loads of an HTTP body but has no UTF-8 form, so
    # safetensors cannot store it: that write fails, the writer goes on.
    dumper = start_dumper(dump_dir, [1])

    run_forward(dumper, [(DumpRequest("lone-\ud800", 2), prompt(100, 2), 0)])
    run_forward(dumper, [(DumpRequest("next", 2), prompt(200, 2), 0)])
    lines = wait_for_manifest(dump_dir, ["next"])

    assert [line["rid"] for line in lines] == ["next"]
    assert stats(dumper)["errors"] == 1
    assert_dir_holds_exactly(dump_dir, lines)


def test_every_manifest_line_names_a_complete_file(dump_dir):
    # wait_for_manifest loads the file of every line each time it reads the manifest,
    # here while the writer is still busy with the requests after it.
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])
    rids = [f"r{i}" for i in range(40)]

    for i, rid in enumerate(rids):
        run_forward(dumper, [(DumpRequest(rid, 50), prompt(1000 + 100 * i, 50), 0)])
        if i % 5 == 0:
            wait_for_manifest(dump_dir, [], timeout=0)
    lines = wait_for_manifest(dump_dir, rids)

    assert [line["rid"] for line in lines] == rids
    assert len({line["file"] for line in lines}) == len(rids)
    assert_dir_holds_exactly(dump_dir, lines)


def wait_for_stats(dumper, done, timeout=WAIT_TIMEOUT_S) -> Dict[str, int]:
    """Poll the dumper's counters until `done(counters)` holds."""
    deadline = time.monotonic() + timeout
    while not done(stats(dumper)):
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout}s: {dumper.stats}")
        time.sleep(0.01)
    return stats(dumper)


def submit_many(dumper, count) -> List[str]:
    rids = [f"r{i}" for i in range(count)]
    for i, rid in enumerate(rids):
        run_forward(dumper, [(DumpRequest(rid, 64), prompt(1000 + 100 * i, 64), 0)])
    return rids


def test_writer_threads_write_files_side_by_side_and_keep_the_manifest_in_order(dump_dir, monkeypatch):
    # The first request's fsync waits until three later files are fsynced: only parallel
    # writers get there. None of them is renamed or listed before the first.
    monkeypatch.setenv("SGLANG_HS_DUMP_WRITER_THREADS", "4")
    fsync = os.fsync
    later_files_synced = []
    seen_while_first_held = []

    def fsync_after_three_others(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        dump_file = name.startswith(hidden_states_dump.TEMP_PREFIX)
        first = dump_file and name.endswith("-000000001.safetensors")
        if first:
            deadline = time.monotonic() + WAIT_TIMEOUT_S
            while len(later_files_synced) < 3:
                assert time.monotonic() < deadline, "no other writer got a file to disk"
                time.sleep(0.01)
            seen_while_first_held.append(sorted(os.listdir(dump_dir)))
        fsync(fd)
        if dump_file and not first:
            later_files_synced.append(name)

    monkeypatch.setattr(os, "fsync", fsync_after_three_others)
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])

    rids = submit_many(dumper, 12)
    lines = wait_for_manifest(dump_dir, rids)

    # Four temporary files on disk, no final file and no manifest yet.
    [seen] = seen_while_first_held
    assert len(seen) == 4 and all(n.startswith(hidden_states_dump.TEMP_PREFIX) for n in seen)
    assert [line["rid"] for line in lines] == rids
    for i, line in enumerate(lines):
        assert_dumped(dump_dir, line, prompt(1000 + 100 * i, 64), [0, 1, 2, 3, 4])
    assert_dir_holds_exactly(dump_dir, lines)


def test_a_full_queue_blocks_by_default_and_loses_nothing(dump_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_QUEUE_SIZE", "1")
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])

    rids = submit_many(dumper, 30)
    lines = wait_for_manifest(dump_dir, rids)

    assert [line["rid"] for line in lines] == rids
    assert stats(dumper)["dropped"] == 0


def test_a_full_queue_in_drop_mode_drops_whole_requests(dump_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_QUEUE_SIZE", "1")
    monkeypatch.setenv("SGLANG_HS_DUMP_ON_FULL_QUEUE", "drop")
    dumper = start_dumper(dump_dir, [0, 1, 2, 3, 4])

    rids = submit_many(dumper, 100)
    counters = wait_for_stats(dumper, lambda c: c["files"] + c["dropped"] == 100)
    lines = read_manifest(str(dump_dir))

    # However many were dropped, each request is either whole on disk or counted.
    assert len(lines) == counters["files"]
    for line in lines:
        i = rids.index(line["rid"])
        assert_dumped(dump_dir, line, prompt(1000 + 100 * i, 64), [0, 1, 2, 3, 4])
    assert_dir_holds_exactly(dump_dir, lines)


def manifest_lines_strictly(dump_dir) -> List[dict]:
    """Every line of the manifest, each required to be whole JSON ending in a newline
    (stricter than read_manifest, which tolerates a torn last line)."""
    data = (dump_dir / hidden_states_dump.MANIFEST_NAME).read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


def test_read_manifest_skips_a_torn_last_line_only(dump_dir):
    # What a reader sees while a line is being appended, or after a kill mid-append.
    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("whole", 2), prompt(100, 2), 0)])
    wait_for_manifest(dump_dir, ["whole"])
    manifest = dump_dir / hidden_states_dump.MANIFEST_NAME
    whole = manifest.read_bytes()

    manifest.write_bytes(whole + b'{"rid": "torn", "fi')
    assert [line["rid"] for line in read_manifest(str(dump_dir))] == ["whole"]

    manifest.write_bytes(b'{"rid": "torn", "fi\n' + whole)
    with pytest.raises(ValueError, match=":1:"):
        read_manifest(str(dump_dir))


def test_a_torn_manifest_line_is_cut_when_the_dumper_starts(dump_dir):
    # A server killed in the middle of appending a line, then started again.
    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("before", 2), prompt(100, 2), 0)])
    wait_for_manifest(dump_dir, ["before"])
    with open(dump_dir / hidden_states_dump.MANIFEST_NAME, "ab") as f:
        f.write(b'{"rid": "killed", "file": "2026')

    dumper = start_dumper(dump_dir, [1])
    run_forward(dumper, [(DumpRequest("after", 2), prompt(200, 2), 0)])
    wait_for_manifest(dump_dir, ["after"])

    lines = manifest_lines_strictly(dump_dir)
    assert [line["rid"] for line in lines] == ["before", "after"]
    assert_dumped(dump_dir, lines[1], prompt(200, 2), [1])


FULL_DISK_BYTES = 4096


def dump_onto_a_full_disk(dump_dir: str) -> None:
    """Run in a child process, as the limit is per process: RLIMIT_FSIZE caps every file
    at FULL_DISK_BYTES, a full disk that the small data files stay under and the growing
    manifest runs into, cut short in the middle of a line. Dumps until a write fails,
    then lifts the limit (space freed) and dumps one more request, "after"."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    dumper = start_dumper(dump_dir, [1])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_DISK_BYTES, hard))
    for i in range(FULL_DISK_BYTES):
        run_forward(dumper, [(DumpRequest(f"r{i}", 2), prompt(100 + 10 * i, 2), 0)])
        counters = wait_for_stats(dumper, lambda c: c["files"] + c["errors"] == i + 1)
        if counters["errors"]:
            break
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    run_forward(dumper, [(DumpRequest("after", 2), prompt(90_000, 2), 0)])
    wait_for_manifest(dump_dir, ["after"])


def test_a_manifest_line_cut_by_a_full_disk_does_not_spoil_the_next(dump_dir):
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tests.unit.test_hidden_states_dump import "
            "dump_onto_a_full_disk; dump_onto_a_full_disk(sys.argv[1])",
            str(dump_dir),
        ],
        cwd=repo_root,
        env=dict(os.environ, PYTHONPATH=os.environ["SGLANG_CHECKOUT"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]

    lines = manifest_lines_strictly(dump_dir)
    rids = [line["rid"] for line in lines]
    # r0..r{n-1} were written, r{n} failed on the manifest, then "after".
    assert rids == [f"r{i}" for i in range(len(rids) - 1)] + ["after"]
    for line in lines[:-1]:
        assert_dumped(dump_dir, line, prompt(100 + 10 * int(line["rid"][1:]), 2), [1])
    assert_dumped(dump_dir, lines[-1], prompt(90_000, 2), [1])
    assert_dir_holds_exactly(dump_dir, lines)


def test_stale_temporary_files_are_removed_at_start(dump_dir):
    stale_name = "20260101T000000-00000000-000000001.safetensors"
    stale = dump_dir / (hidden_states_dump.TEMP_PREFIX + stale_name)
    stale.write_bytes(b"half a file")
    kept = dump_dir / "notes.txt"
    kept.write_text("not ours")

    start_dumper(dump_dir, [1])

    assert sorted(os.listdir(dump_dir)) == ["notes.txt"]


def test_a_rank_that_does_not_write_dumps_nothing(dump_dir):
    metadata = {"layer_ids": "[1]", "num_layers": str(NUM_LAYERS)}
    dumper = HiddenStatesDumper(str(dump_dir), [1], is_writer=False, metadata=metadata)

    run_forward(dumper, [(DumpRequest("r", 2), prompt(100, 2), 0)])

    assert dumper.stats == ""
    assert os.listdir(dump_dir) == []


def test_read_manifest_of_an_empty_directory(dump_dir):
    assert read_manifest(str(dump_dir)) == []


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "barrier", "broadcast",
               "broadcast_object_list", "reduce_scatter", "gather", "scatter", "send", "recv",
               "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"}


def test_the_dump_module_calls_no_collective():
    """Only the writing rank runs most of the dump, so a collective in it would hang the
    other ranks: the module must not call one (the capture's gather runs in the model, on
    every rank)."""
    import ast
    import inspect

    from sglang.srt.managers import hidden_states_dump

    tree = ast.parse(inspect.getsource(hidden_states_dump))
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and node.module}
    assert not called & COLLECTIVES
    assert "torch.distributed" not in imported
    assert "get_pp_group" in called, "the check must see the module's calls"
