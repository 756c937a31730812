"""The dumper driven as the model drives it, one `capture` per forward on the stand-in
model: which rows of a batch are dumped, chunked prefills stitched into one file, and
what is discarded."""

import os
from types import SimpleNamespace

import torch

from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper
from sglang.srt.hidden_states_dump.format import load_dump
from sglang.srt.hidden_states_dump.requests import DumpRequest
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from tests.unit.dump_standins import (
    NUM_LAYERS,
    dump_config,
    stand_in_metadata,
    assert_dir_holds_exactly,
    assert_dumped,
    final_rows,
    layer_rows,
    prompt,
    run_decode,
    run_forward,
    start_dumper,
    stats,
    wait_for_manifest,
    wait_for_stats,
    wait_for_writer,
)


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


def test_the_packed_aux_form_dumps_like_the_list_form(dump_dir):
    """From 0.5.23 the model hands one [T, K*H] tensor (upstream's AuxHiddenStatePacker):
    the layers side by side in ascending id order, whatever order they are configured in."""
    layer_ids = [3, 0, 2]
    dumper = start_dumper(dump_dir, layer_ids)
    tokens = prompt(100, 3)
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        hidden_states_dump_requests=[DumpRequest("packed", 3)],
        extend_prefix_lens_cpu=[0],
        extend_seq_lens_cpu=[3],
        input_ids=torch.tensor(tokens, dtype=torch.int32),
    )
    packed = torch.cat([layer_rows(tokens, layer_id) for layer_id in sorted(layer_ids)], dim=-1)

    dumper.capture(forward_batch, final_rows(tokens), packed)
    (line,) = wait_for_manifest(dump_dir, ["packed"])

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


def test_a_rank_that_does_not_write_dumps_nothing(dump_dir):
    dumper = HiddenStatesDumper(dump_config(dump_dir), stand_in_metadata([1]), is_writer=False)

    run_forward(dumper, [(DumpRequest("r", 2), prompt(100, 2), 0)])

    assert dumper.counters() is None
    assert os.listdir(dump_dir) == []


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "barrier", "broadcast",
               "broadcast_object_list", "reduce_scatter", "gather", "scatter", "send", "recv",
               "tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"}


def test_the_dump_package_calls_no_collective():
    """Only the writing rank runs most of the dump, so a collective in it would hang the
    other ranks: no module of the package may call one (the capture's gather runs in the
    model, on every rank)."""
    import ast
    from pathlib import Path

    import sglang.srt.hidden_states_dump as package

    sources = sorted(Path(package.__file__).parent.glob("*.py"))
    assert len(sources) > 5
    tree = ast.Module(body=[node for path in sources for node in ast.parse(path.read_text()).body],
                      type_ignores=[])
    called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
              for node in ast.walk(tree) if isinstance(node, ast.Call)}
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and node.module}
    assert not called & COLLECTIVES
    assert "torch.distributed" not in imported
    assert "get_pp_group" in called, "the check must see the module's calls"


def test_the_forwards_tensors_refilled_after_capture_leave_the_dump_unchanged(dump_dir, monkeypatch):
    """The copier reads the rows after the forward has gone on, and SGLang refills some of
    the forward's tensors for the next forward (0.5.23's input ids' buffer, int64 on the
    CPU): what capture hands the copier must be its own."""
    from sglang.srt.hidden_states_dump.copier import RowsCopier

    held = []
    submit = RowsCopier.submit
    monkeypatch.setattr(RowsCopier, "submit", lambda self, *job: held.append((self, job)))
    layer_ids = [0, 2]
    dumper = start_dumper(dump_dir, layer_ids)
    tokens = prompt(100, 5)
    for form in ("list", "packed"):
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            hidden_states_dump_requests=[DumpRequest(form, 5)],
            extend_prefix_lens_cpu=[0],
            extend_seq_lens_cpu=[5],
            input_ids=torch.tensor(tokens, dtype=torch.int64),
        )
        aux = [layer_rows(tokens, layer_id) for layer_id in sorted(layer_ids)]
        if form == "packed":
            aux = torch.cat(aux, dim=-1)
        final = final_rows(tokens)
        dumper.capture(forward_batch, final, aux)
        # The next forward refills them before the copier gets to this one's rows.
        for tensor in [forward_batch.input_ids, final, *(aux if form == "list" else [aux])]:
            tensor.fill_(7)
    for copier, job in held:
        submit(copier, *job)

    lines = wait_for_manifest(dump_dir, ["list", "packed"])
    for line in lines:
        assert_dumped(dump_dir, line, tokens, layer_ids)
