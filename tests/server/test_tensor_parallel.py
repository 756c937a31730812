"""The seed's layout on the CPU: eight tensor-parallel ranks (make test-tensor-parallel).

One server of eight ranks (a DeepSeek-V3 with eight heads, chunked prefill, the radix cache
on) serves, with dumping on, the compared requests one at a time and then the workload's two
rounds (tests/server/tensor_parallel.py), and:
- every request, prompt-only or with its answer, is written once: one file, one manifest
  line, by attention-TP rank 0's writer alone; the response names the file;
- a prompt whose prefix the cache holds, and a prompt served before, are dumped whole;
- every row equals rank 0's forward hooks on the same server exactly (after each all-reduce
  the ranks hold the same stream);
- the compared requests' rows equal a TP1 server's within TP_ROW_TOLERANCE wherever both
  routed the row to the same experts, and one layer further on they do not (the negative
  control);
- last, a fault inside the dump on rank 5 of 8 mid-serving stops the whole server within
  FAILURE_EXIT_S, the fault in its log, every listed file complete.
Then, each a server of its own: the reduced Kimi-K2.5 at TP8; DP attention at TP8 (a
manifest per attention-DP group, every request once); the seed's naive patch at TP8, every
rank failing the warmup and all of them ended (the negative control the series is judged
by); a fault on rank 5 in warmup; and a refusal from each of the dump's startup checks,
each stopping all eight ranks with nothing left running.

TP_ROW_TOLERANCE: with eight ranks each o_proj and MLP down projection ends in an all-reduce
of eight bf16 partial sums, which gloo adds in another order, with seven more bf16 roundings
(each up to 2^-9 of the running sum), than one rank's matmul accumulates; the residual
stream keeps the difference, two all-reduces a layer. A probe of one 37-token prompt saw at
most 8.0e-3 in a row at TP8 and 3.5e-3 at TP2, layer 0 (the embedding) bit-equal at every
size and repeat launches bit-identical. 3e-2 a row is about eight bf16 roundings of the row
(2^-8 each, relative) over three layers, four times what the probe saw, and a thirtieth of
what a rank dumping its partial sum is off by (about 1). Two things a reduction order does
not explain are kept out of the comparison, each for a reason measured here:
- a row whose token took other experts in one server (a routing tie that the reduction's
  rounding tips) differs by the experts' difference, 0.4-0.5 after this model's MoE layers:
  the hooks record each row's experts, such rows are left out and counted, and more than
  MAX_REROUTED_SHARE of them fails;
- SGLang's CPU prefill attention reads the KV pool instead of the keys and values it computed
  (upstream, FINDINGS), so a row depends on the slots its request was given and what they
  held: in one workload sent at once to both servers, three whole requests differed by about
  1 at every layer past the embedding, while their hooks equalled their dumps on each server.
  The compared requests are therefore each server's first after warmup, one at a time; so
  sent, every row that took the same experts was within 1.1e-2 of TP1's (4 of 445 rows took
  other experts).
"""

import json
import os
import re
import time
import urllib.error

import pytest
import torch

from scripts.dump_format import ANSWER_PARAM, ANSWER_TOKENS_FIELD, META_INFO_KEY, load_dump, read_manifest
from scripts.dumps.inspect_dump import summarise
from scripts.dumps.server import STALL_TIMEOUT_S, Server, ServerFailed, runtime_env, wait_for_manifest
from scripts.dumps.tiny_model import ensure_kimi_model, ensure_model
from tests.server import cpu_dp_attention, oracle_hooks
from tests.server.dump_checks import OracleServer, post_all, relative_errors
from tests.server.fault_hooks import fail_in_the_dump_spec
from tests.server.tensor_parallel import CHUNK, compared_requests, tp_args, tp_env, wait_for_group_gone, workload
from tests.server.test_warmup import LOADED_START_LIMIT_S, kimi_k25_server_settings, tree_without  # noqa: F401

TP = 8
NUM_LAYERS = 3
MOE_LAYERS = [1, 2]  # the model's first layer is dense (first_k_dense_replace)
LAYERS = [0, 1, 2, 3]
# Rows that took other experts in TP8 than in TP1 are left out of the TP1 comparison; more
# than this share of them would be no routing tie but a wrong stream.
MAX_REROUTED_SHARE = 0.05
TP_ROW_TOLERANCE = 3e-2
FAULT_RANK = 5
# A server with a failed rank must be gone this soon after the failure: SGLang's launcher
# ends the process tree as soon as a scheduler process dies (about a second after it, seen
# at TP2); the rest is eight processes exiting on loaded cores.
FAILURE_EXIT_S = 120
SERVER_ARGS = ["--chunked-prefill-size", str(CHUNK)]

pytestmark = pytest.mark.skipif(
    tuple(map(int, os.environ["SGLANG_VERSION"].split("."))) < (0, 5, 14),
    reason="0.5.9's CPU tensor parallelism does not start: its NCCL wrapper wants a CUDA device",
)


@pytest.fixture(scope="module")
def model():
    return ensure_model(layers=NUM_LAYERS, q_lora=True, widths="cpu-8heads")


def wait_ready(server: Server) -> Server:
    """Eight ranks start in minutes on two cores: wait as long as the server makes progress."""
    return server.wait_ready(timeout=LOADED_START_LIMIT_S, stall_timeout=STALL_TIMEOUT_S)


def serve(server: Server, rounds):
    """Each round's requests at once, one round after the other; the responses by rid."""
    responses = {}
    for bodies in rounds.values():
        responses.update(zip((b["rid"] for b in bodies), post_all(server, bodies, workers=16)))
    return responses


def serve_one_at_a_time(server: Server, bodies):
    return {b["rid"]: server.post("/generate", b) for b in bodies}


def expected_rows(body, response):
    """The tokens a request's sample holds: its prompt, and the answer's but the last token."""
    if body["sampling_params"]["custom_params"].get(ANSWER_PARAM):
        return body["input_ids"] + response["output_ids"][:-1]
    return body["input_ids"]


class Served:
    """A dumping server with its oracle, once it has served `compared` (one at a time, first)
    and then `rounds`: the requests, their responses and the manifest; `forwards` counts the
    oracle's saved forwards after each stage ("compared", then each round's name)."""

    def __init__(self, server, compared, rounds=None):
        self.server, self.compared, self.rounds = server, compared, rounds or {}
        self.responses = serve_one_at_a_time(server, compared)
        self.forwards = {"compared": len(oracle_hooks.forward_files(server.oracle_dir))}
        for name, bodies in self.rounds.items():
            self.responses.update(serve(server, {name: bodies}))
            self.forwards[name] = len(oracle_hooks.forward_files(server.oracle_dir))
        self.bodies = compared + [b for bodies in self.rounds.values() for b in bodies]
        self.manifest = wait_for_manifest(server.dump_dir, len(self.bodies))

    def records(self):
        by_rid = {entry["rid"]: entry for entry in self.manifest}
        return {rid: load_dump(str(self.server.dump_dir / entry["file"])) for rid, entry in by_rid.items()}

    def compared_streams(self):
        """Per compared rid, the oracle's streams and experts of its rows."""
        sequences = {b["rid"]: expected_rows(b, self.responses[b["rid"]]) for b in self.compared}
        streams, _ = oracle_hooks.request_rows(self.server.oracle_dir, sequences)
        return streams


@pytest.fixture(scope="module")
def tp1(model, tmp_path_factory):
    """A TP1 server's dump of the compared requests: the yardstick of the reduction order."""
    tmp_path = tmp_path_factory.mktemp("tp1")
    server = OracleServer(model, tmp_path, NUM_LAYERS, SERVER_ARGS, record_decode=True, moe_layers=MOE_LAYERS,
                          SGLANG_HS_DUMP_LAYERS=",".join(map(str, LAYERS)))
    with server:
        wait_ready(server)
        served = Served(server, compared_requests(ANSWER_PARAM))
        return served.records(), served.compared_streams()


@pytest.fixture(scope="module")
def tp8(model, tmp_path_factory):
    """The TP8 server, up for the whole module; it has served the compared requests, then the
    workload's rounds. Rank 0's hooks record every forward; the dump faults on rank FAULT_RANK
    once a request named `fault-...` reaches it (the module's last test)."""
    tmp_path = tmp_path_factory.mktemp("tp8")
    server = OracleServer(
        model, tmp_path, NUM_LAYERS, [*SERVER_ARGS, *tp_args(TP)], record_decode=True, oracle_rank=0,
        moe_layers=MOE_LAYERS,
        extra_hooks=json.loads(fail_in_the_dump_spec(FAULT_RANK, tmp_path / "fault", rid_prefix="fault-")),
        SGLANG_HS_DUMP_LAYERS=",".join(map(str, LAYERS)), **tp_env(TP))
    server.fault_marker = tmp_path / "fault"
    with server:
        wait_ready(server)
        yield Served(server, compared_requests(ANSWER_PARAM), workload(ANSWER_PARAM))


def test_every_request_is_written_once_by_rank_0(tp8):
    rids = [b["rid"] for b in tp8.bodies]
    listed = [entry["rid"] for entry in tp8.manifest]
    assert sorted(listed) == sorted(rids), "one manifest line a request"
    dump_dir = tp8.server.dump_dir
    assert sorted(p.name for p in dump_dir.iterdir() if p.name.startswith("manifest")) == ["manifest.jsonl"]
    assert sorted(p.name for p in dump_dir.iterdir() if p.suffix == ".safetensors") == sorted(
        entry["file"] for entry in tp8.manifest), "one file a request, each listed"
    for body in tp8.bodies:
        [reported] = tp8.responses[body["rid"]]["meta_info"][META_INFO_KEY]
        entry = next(e for e in tp8.manifest if e["rid"] == body["rid"])
        assert reported["file"] == entry["file"]
        assert entry["num_tokens"] == len(expected_rows(body, tp8.responses[body["rid"]]))
        if body["sampling_params"]["custom_params"].get(ANSWER_PARAM):
            assert entry[ANSWER_TOKENS_FIELD] == body["sampling_params"]["max_new_tokens"] - 1
    # Only attention-TP rank 0 writes: one writer started, in rank 0's process.
    writer_lines = re.findall(r"^.*hidden states dump on: dir=.*$", tp8.server.log(), re.MULTILINE)
    assert len(writer_lines) == 1 and "TP0" in writer_lines[0], writer_lines


def test_rows_equal_rank_0s_hooks_exactly(tp8):
    """Every request, prompt and answer rows, against rank 0's own forwards; each stage's
    prompts are looked for only in its own forwards, so a second-round dump that took the
    cached prefix's rows from the first round would miss positions there."""
    records = tp8.records()
    stages = [("compared", tp8.compared, 0)]
    previous = "compared"
    for name, bodies in tp8.rounds.items():
        stages.append((name, bodies, tp8.forwards[previous]))
        previous = name
    for name, bodies, first_forward in stages:
        sequences = {b["rid"]: expected_rows(b, tp8.responses[b["rid"]]) for b in bodies}
        streams, _ = oracle_hooks.request_rows(tp8.server.oracle_dir, sequences, first_forward)
        for body in bodies:
            record = records[body["rid"]]
            assert record.token_ids.tolist() == sequences[body["rid"]]
            for k, layer_id in enumerate(record.layer_ids):
                assert torch.equal(record.hidden_states[:, k], streams[body["rid"]][str(layer_id)]), (
                    f"{name} {body['rid']}: layer {layer_id} differs from rank 0's hooks")
            assert torch.equal(record.last_hidden_state, streams[body["rid"]]["last"]), body["rid"]


def same_experts(tp8_streams, tp1_streams, rid, before_layer: int) -> torch.Tensor:
    """Per row of `rid`: did both servers route it to the same experts in every MoE layer
    before `before_layer`? A token near a routing tie may take another expert in one of them,
    and its row then differs by the experts' difference, not by the reduction order."""
    same = torch.ones(tp1_streams[rid]["0"].shape[0], dtype=torch.bool)
    for layer in MOE_LAYERS:
        if layer < before_layer:
            same &= (tp8_streams[rid][f"experts.{layer}"] == tp1_streams[rid][f"experts.{layer}"]).all(dim=-1)
    return same


def row_errors(tp8, tp1, shift: int = 0):
    """Per compared rid and dumped layer: the relative errors of TP8's rows against TP1's rows
    of the layer `shift` places further in the dumped layers, on the rows both servers routed
    alike; and how many rows were routed otherwise."""
    tp1_records, tp1_streams = tp1
    records, tp8_streams = tp8.records(), tp8.compared_streams()
    errors, rerouted, rows = {}, 0, 0
    for body in tp8.compared:
        rid = body["rid"]
        record, reference = records[rid], tp1_records[rid]
        assert record.token_ids.tolist() == reference.token_ids.tolist(), f"{rid}: TP8 and TP1 decoded differently"
        points = [(layer, record.hidden_states[:, k], k) for k, layer in enumerate(record.layer_ids)]
        points.append((NUM_LAYERS + 1, record.last_hidden_state, len(record.layer_ids)))
        for layer, value, k in points:
            if k + shift > len(reference.layer_ids):
                continue
            expected = reference.last_hidden_state if k + shift == len(reference.layer_ids) else \
                reference.hidden_states[:, k + shift]
            same = same_experts(tp8_streams, tp1_streams, rid, layer)
            errors[(rid, layer)] = relative_errors(value[same], expected[same])
        rerouted += int((~same_experts(tp8_streams, tp1_streams, rid, NUM_LAYERS + 1)).sum())
        rows += len(record.token_ids)
    return errors, rerouted, rows


def test_rows_equal_tp1s_within_the_reduction_order(tp8, tp1):
    errors, rerouted, rows = row_errors(tp8, tp1)
    worst = {layer: max(e.max().item() for (_, l), e in errors.items() if l == layer and e.numel())
             for layer in LAYERS + [NUM_LAYERS + 1]}
    print(f"worst row per dumped point, TP8 against TP1 (L+1: last_hidden_state): {worst}; "
          f"rows routed to other experts: {rerouted} of {rows}")
    assert all(torch.equal(e, torch.zeros_like(e)) for (_, layer), e in errors.items() if layer == 0), \
        "the embedding differs"
    too_far = {key: e.max().item() for key, e in errors.items() if e.numel() and e.max() > TP_ROW_TOLERANCE}
    assert not too_far, too_far
    assert rerouted <= MAX_REROUTED_SHARE * rows, f"{rerouted} of {rows} rows took other experts"


def test_shifted_layer_breaks_the_tp1_bound(tp8, tp1):
    """The negative control: the same rows against TP1's next dumped point are farther than
    the bound, at the median row of every compared request and point."""
    errors, _, _ = row_errors(tp8, tp1, shift=1)
    medians = {key: e.median().item() for key, e in errors.items() if e.numel()}
    assert medians and all(median > TP_ROW_TOLERANCE for median in medians.values()), {
        key: median for key, median in medians.items() if median <= TP_ROW_TOLERANCE}


def test_a_fault_on_rank_5_mid_serving_stops_every_rank(tp8):
    """Last in the module: it ends the server. Rank 5 raises inside the dump on the forward
    of a request named fault-...; every process of the server is gone within FAILURE_EXIT_S
    of the fault, its log names it, and the dump lists only complete files."""
    server = tp8.server
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        server.post("/generate", {"rid": "fault-0", "input_ids": list(range(100, 140)),
                                  "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=FAILURE_EXIT_S)
    assert server.fault_marker.exists(), "the fault did not fire"
    fired_at = server.fault_marker.stat().st_mtime
    server.wait_exit(timeout=FAILURE_EXIT_S)
    wait_for_group_gone(server, FAILURE_EXIT_S - (time.time() - fired_at))
    assert f"injected failure in the dump on rank {FAULT_RANK}" in server.log()
    summary = summarise(server.dump_dir)
    assert summary.problems == [], summary.problems
    assert summary.requests >= len(tp8.bodies)


# --- servers of their own ----------------------------------------------------------------


def test_kimi_k25_at_tp8_dumps_its_text_model_once_equal_to_rank_0s_hooks(tmp_path):
    kimi = ensure_kimi_model(layers=2, q_lora=True, widths="cpu-8heads")
    extra_args, env = kimi_k25_server_settings()
    server = OracleServer(kimi, tmp_path, 2, [*extra_args, *SERVER_ARGS, *tp_args(TP)], decoder="language_model.model",
                          oracle_rank=0, **env, **tp_env(TP))
    bodies = workload(ANSWER_PARAM)["first"]
    with server:
        wait_ready(server)
        responses = dict(zip((b["rid"] for b in bodies), post_all(server, bodies, workers=16)))
        manifest = wait_for_manifest(server.dump_dir, len(bodies))
    assert sorted(e["rid"] for e in manifest) == sorted(b["rid"] for b in bodies)
    assert len({e["file"] for e in manifest}) == len(bodies)
    sequences = {b["rid"]: expected_rows(b, responses[b["rid"]]) for b in bodies if b["rid"].startswith("prompt")}
    streams, _ = oracle_hooks.request_rows(server.oracle_dir, sequences)
    for entry in manifest:
        if entry["rid"] not in sequences:
            continue
        record = load_dump(str(server.dump_dir / entry["file"]))
        assert record.layer_ids == [0, 2]  # the text model's default layers for L=2
        for k, layer_id in enumerate(record.layer_ids):
            assert torch.equal(record.hidden_states[:, k], streams[entry["rid"]][str(layer_id)]), entry["rid"]


def test_dp_attention_at_tp8_writes_a_manifest_per_group_and_every_request_once(model, tmp_path):
    dp = 2
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), **tp_env(TP))
    # 0.5.23's DP attention asks the attention backend for a method torch_native lacks
    # (tests/server/cpu_dp_attention.py); without it every rank raises at warmup.
    args = [*SERVER_ARGS, *tp_args(TP), "--dp-size", str(dp), "--enable-dp-attention",
            "--forward-hooks", json.dumps(cpu_dp_attention.spec())]
    bodies = [b for bodies in workload(ANSWER_PARAM).values() for b in bodies]
    with Server(model, tmp_path / "server.log", env, args) as server:
        wait_ready(server)
        responses = dict(zip((b["rid"] for b in bodies), post_all(server, bodies, workers=16)))
        manifest = wait_for_manifest(server.dump_dir, len(bodies))
        log = server.log()
    dump_dir = tmp_path / "dump"
    manifests = sorted(p.name for p in dump_dir.iterdir() if p.name.startswith("manifest"))
    assert manifests == ["manifest-dp1.jsonl", "manifest.jsonl"], manifests
    per_group = {name: [json.loads(line)["rid"] for line in (dump_dir / name).read_text().splitlines()]
                 for name in manifests}
    print("requests per attention-DP group:", {name: len(rids) for name, rids in per_group.items()})
    assert sorted(rid for rids in per_group.values() for rid in rids) == sorted(b["rid"] for b in bodies)
    assert sorted(p.name for p in dump_dir.iterdir() if p.suffix == ".safetensors") == sorted(e["file"] for e in manifest)
    for body in bodies:
        [reported] = responses[body["rid"]]["meta_info"][META_INFO_KEY]
        assert reported["file"] in {e["file"] for e in manifest}
    assert summarise(dump_dir).problems == []
    writer_lines = re.findall(r"^.*hidden states dump on: dir=.*$", log, re.MULTILINE)
    assert len(writer_lines) == dp, writer_lines


def test_naive_patch_at_tp8_fails_every_rank_at_warmup_and_leaves_nothing_running(model, naive_tree, tmp_path):
    """The seed's failure at the seed's rank count: with none of [3, 31, 59] below L=3 the
    model returns a bare tensor, and the forward's unpack raises on every rank in the same
    warmup prefill; the launcher then ends them all. (On GPUs one rank failing while the
    others wait in a collective is the seed's hang: the fault tests make that happen.)"""
    server = Server(model, tmp_path / "server.log", runtime_env(tree=naive_tree, **tp_env(TP)), tp_args(TP))
    with server:
        with pytest.raises(ServerFailed, match="too many values to unpack"):
            wait_ready(server)
        wait_for_group_gone(server, FAILURE_EXIT_S)
        log = server.log()
    failing_ranks = set(re.findall(r"\[[^\]]*TP(\d)[^\]]*\] Scheduler hit an exception", log))
    print("ranks that logged the failure:", sorted(failing_ranks))
    assert failing_ranks, log[-3000:]


def test_a_fault_on_rank_5_in_warmup_stops_every_rank(model, tmp_path):
    marker = tmp_path / "fault"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), **tp_env(TP))
    server = Server(model, tmp_path / "server.log", env,
                    [*tp_args(TP), "--forward-hooks", fail_in_the_dump_spec(FAULT_RANK, marker)])
    with server:
        with pytest.raises(ServerFailed, match=f"injected failure in the dump on rank {FAULT_RANK}"):
            wait_ready(server)
        wait_for_group_gone(server, FAILURE_EXIT_S - (time.time() - marker.stat().st_mtime))
        log = server.log()
    assert "ready to roll" not in log
    assert not (tmp_path / "dump" / "manifest.jsonl").exists() or read_manifest(str(tmp_path / "dump")) == []


# Refusals at eight ranks: a layer id out of range, a multi-GPU layout the dump refuses (two
# pipeline stages of four ranks) and, below, a series missing a patch. Every startup check
# runs on every rank, in one function (HiddenStatesDumper.from_env), before anything a rank
# does differs from another's; each refused setting is tested at TP1 (test_warmup.py) and
# in the config's unit tests. A TP8 refusal costs two minutes of CI (eight ranks importing
# SGLang), so not every setting is refused again here.

REFUSALS = {
    "layer-out-of-range": ({"SGLANG_HS_DUMP_LAYERS": "1,4"}, [],
                           r"\[4\] out of range; the model has L=3 layers, so valid ids are 0..3"),
    # Eight ranks as two pipeline stages of four: each stage runs only its own layers.
    "pipeline-stages": ({}, ["--pp-size", "2"], r"pipeline parallelism \(--pp-size > 1\)"),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_setting_stops_all_eight_ranks(model, tmp_path, refusal):
    settings, args, message = REFUSALS[refusal]
    env = {"SGLANG_HS_DUMP_DIR": str(tmp_path / "dump"), **settings}
    stages = int(args[args.index("--pp-size") + 1]) if "--pp-size" in args else 1
    with Server(model, tmp_path / "server.log", runtime_env(**env, **tp_env(TP)),
                [*tp_args(TP // stages), *args]) as server:
        assert_refused(server, message)


@pytest.mark.parametrize("tree_without", ["drain-the-dump-before-a-scheduler-process-goes"], indirect=True)
def test_a_series_without_a_patch_stops_all_eight_ranks(model, tree_without, tmp_path):
    concern = "drain-the-dump-before-a-scheduler-process-goes"
    env = runtime_env(tree=tree_without, SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), **tp_env(TP))
    with Server(model, tmp_path / "server.log", env, tp_args(TP)) as server:
        assert_refused(server, rf"lacks series patches the hidden states dump relies on: {concern} ")


def assert_refused(server: Server, message: str):
    """The server exits (non-zero) before it is ready, naming `message`, and every process of
    it is gone."""
    code = server.wait_exit(timeout=LOADED_START_LIMIT_S, stall_timeout=STALL_TIMEOUT_S)
    wait_for_group_gone(server, FAILURE_EXIT_S)
    log = server.log()
    assert code != 0
    assert re.search(message, log), log[-3000:]
    assert "ready to roll" not in log
