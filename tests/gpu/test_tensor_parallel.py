"""Tensor parallelism (at least 2 GPUs; the seed's TP8 on a machine of 8): under TP (TP = 8 where
eight GPUs are, else 2: plain, which on SM90 auto-enables flashinfer's all-reduce + RMSNorm fusion
for DeepSeek-V3 at TP > 1, with the fusion forced off, with it asked for by flag, and with DP
attention over TP groups, one manifest each) the dump holds what transformers computes on the same weights, as closely
as TP1 does; one file per request; a 61-layer model dumps the seed's default layers; a rank that
fails during warmup stops the server instead of hanging it.

The rule, per prompt and capture point l (each layer id dumped, and last_hidden_state), with
err(x) = ||x - transformers float32|| / ||transformers float32|| on the same weights and prompt:

    err(any configuration, l) <= 2 * err(transformers bf16, l) + 5e-3
    err(TP configuration, l) <= 2 * err(TP1, l) + 5e-3

A bf16 engine is not bit-equal to another, nor to itself from one launch to the next (a token
near a routing tie changes experts), so a fixed bound either fails deep models (61 layers:
2e-2 from float32 at layer 59, transformers' own bf16 7.5e-2) or is loose at 4 layers. The
bounds scale with what bf16 itself does at that depth. 5e-3 is about one layer of bf16
rounding (TP1 at layer 1 is 5.0e-3 from float32, tests/gpu/test_gpu_capture.py), the margin
for shallow layers where the two engines' errors are of the same size. The bug these tests
exist for, a rank dumping its partial sum, is off by about 1: both bounds still catch it.
Each launch checks that they do, on its own values (negative controls, `assert_controls_fail`):
each dumped layer compared with the next layer's float32 stream (a layer shifted by one), and
the midpoint of two adjacent dumped layers (the mean of the two ranks' partial sums when one
layer's output is not all-reduced) compared with the later one, must break the rule at every
prompt. Each launch also checks that the files and the manifest hold the layers it asked for,
and reports and bounds each capture point's worst row (WORST_ROW_BOUND) beside its norm.

Device time at TP2 (two H200s, 2026-11-30; TP8 has not run): eight server launches, one after
the other (TP takes every GPU):
  4 layers:  TP1 without CUDA graphs ~1 min; TP plain, fusion off, fusion by flag, DP attention
             with CUDA graphs ~1.5-2 min each. One launch per configuration serves all prompts.
  61 layers: TP1 and TP without CUDA graphs, ~1.5 min each (with graphs TP2 was ready only
             after 261 s; a dumped prefill runs eagerly either way, patch 0007).
  rank failure: TP without CUDA graphs, exits in ~2 min (the test gives up at 3 min).
transformers adds under a minute. The module takes more than one device command (10 min), so
run it in three calls, on nvidia-h100-x8 (or -x2) with the bundle carried:
    bash scripts/bench/gpu/run_checks.sh tests/gpu/test_tensor_parallel.py -k against_transformers
    bash scripts/bench/gpu/run_checks.sh tests/gpu/test_tensor_parallel.py -k 61_layers
    bash scripts/bench/gpu/run_checks.sh tests/gpu/test_tensor_parallel.py -k rank_failing
Per-layer errors land in $GPU_RESULTS under "tensor-parallel/..." as each launch finishes.
Skipped below 2 GPUs.
"""

import json
import random
import re
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from scripts.dumps.server import READY_LINE, Server, ServerFailed, has_gpu, runtime_env, wait_for_manifest
from scripts.dumps.tiny_model import ensure_model
from tests.gpu.probe_hooks import count_allreduce_fusion_spec
from tests.gpu.test_gpu_capture import record_result, relative_error, transformers_streams

pytestmark = pytest.mark.skipif(not has_gpu() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
# The seed's layout where the machine has it: Kimi-K2.5 serves at TP8 on one node.
TP = 8 if has_gpu() and torch.cuda.device_count() >= 8 else 2
# The rank that fails in warmup: at TP8 one in the middle (the seed's hang was one rank
# failing while seven waited), at TP2 the other one.
FAILING_RANK = 5 if TP == 8 else 1

NUM_LAYERS = 4
LAYERS = "0,1,2,3,4"
LAYER_IDS = [0, 1, 2, 3, 4]
PROMPT_LENGTHS = (100, 700, 3000)  # under and over the 2048-token all-reduce fusion limit
# Two bf16 engines are not equally far from float32 at every layer: on the 4-layer model
# SGLang TP1 was 1.4x transformers bf16's error at layer 2 of the 700-token prompt (0.0178
# vs 0.0129) and TP2 1.7x (0.0222), while both were below it elsewhere.
MARGIN_OVER_TRANSFORMERS_BF16 = 2.0
TP_FACTOR_OVER_TP1 = 2.0
ERROR_FLOOR = 5e-3
# The worst row's relative error, per prompt and capture point. GPU.md records norms only:
# the largest is 2.6e-2 (61 layers, TP1, layer 59; 2.2e-2 at 4 layers, TP2, layer 2), while
# a partial sum is off by about 1. A row is a 256-wide vector rounded to bf16 like the rest,
# but a token near a routing tie may take another expert in one engine and not the other,
# which the norm over thousands of rows averages away; 0.25 leaves such a row ten times the
# worst norm GPU.md records and is still a quarter of a partial sum's error.
WORST_ROW_BOUND = 0.25
READY_TIMEOUT_S = 480
FAILURE_EXIT_TIMEOUT_S = 180
# TP1 is the yardstick, not the subject: it runs without CUDA graphs, which saves about a
# minute per launch and changes no dumped value (a prefill holding a dumped request runs
# eagerly with graphs on too, patch 0007; test_gpu_capture.py finds the two bit-equal).
TP1_ARGS = ["--disable-cuda-graph"]
TP_CONFIGURATIONS = {
    f"tp{TP}": ["--tp-size", str(TP)],
    f"tp{TP}-no-allreduce-fusion": ["--tp-size", str(TP), "--enforce-disable-flashinfer-allreduce-fusion"],
    f"tp{TP}-allreduce-fusion": ["--tp-size", str(TP), "--enable-flashinfer-allreduce-fusion"],
    f"tp{TP}-dp-attention": ["--tp-size", str(TP), "--dp-size", str(TP), "--enable-dp-attention"],
}
# What the log says about all-reduce fusion, kept for GPU.md (did the fusion engage?).
FUSION_LOG = re.compile(r"all.?reduce|fusion", re.IGNORECASE)

# Errors by prompt length (as a string: JSON keys), then capture point ("0".."L", "last_hidden_state").
Errors = Dict[str, Dict[str, float]]
# Dumped values the same way, as float32 on the CPU.
Points = Dict[str, Dict[str, torch.Tensor]]


def random_prompt(length: int) -> List[int]:
    rng = random.Random(length)
    return [rng.randrange(5, 1000) for _ in range(length)]


def dumped_points(record) -> Dict[str, torch.Tensor]:
    points = {str(layer): record.hidden_states[:, k] for k, layer in enumerate(record.layer_ids)}
    points["last_hidden_state"] = record.last_hidden_state
    return points


def errors_against(float32, streams: Dict[str, Dict[str, torch.Tensor]]) -> Errors:
    """Relative error against float32, per prompt and capture point of `streams`."""
    return {length: {name: relative_error(value, float32[length][name]) for name, value in points.items()}
            for length, points in streams.items()}


def worst_row_errors(float32, streams: Dict[str, Dict[str, torch.Tensor]]) -> Errors:
    """The largest per-row relative error against float32, per prompt and capture point."""
    def worst(value, expected):
        value, expected = value.float(), expected.float()
        return ((value - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)).max().item()

    return {length: {name: worst(value, float32[length][name]) for name, value in points.items()}
            for length, points in streams.items()}


def transformers_reference(model: Path, prompts: Sequence[List[int]], name: str):
    """float32 streams (what SGLang's bf16 approximates) and transformers bf16's own errors."""
    float32 = transformers_streams(model, prompts, torch.float32)
    bf16_errors = errors_against(float32, transformers_streams(model, prompts, torch.bfloat16))
    record_result(f"tensor-parallel/{name}/transformers-bf16",
                  {"relative_error_vs_transformers_float32": bf16_errors})
    return float32, bf16_errors


def dump_errors(model: Path, prompts: Sequence[List[int]], float32, launch_dir: Path, name: str,
                extra_args: Sequence[str], expected_layers: List[int], layers: Optional[str] = None):
    """One launch: every prompt once, one file each, holding `expected_layers` (what `layers`
    asks for, or the default); (errors against float32, the dumped points). Reports each
    point's worst row beside its norm, and bounds it."""
    from scripts.dump_format import load_dump

    dump_dir = launch_dir / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), **({"SGLANG_HS_DUMP_LAYERS": layers} if layers else {}))
    started = time.monotonic()
    with Server(model, launch_dir / "server.log", env, list(extra_args)) as server:
        server.wait_ready(timeout=READY_TIMEOUT_S)
        ready_s = time.monotonic() - started
        for prompt in prompts:
            server.generate(prompt, max_new_tokens=2)
        manifest = wait_for_manifest(dump_dir, len(prompts))
        log = server.log()
    records = [load_dump(str(dump_dir / entry["file"])) for entry in manifest]
    assert sorted(r.token_ids.tolist() for r in records) == sorted(prompts), \
        f"{name}: one file per request, whatever the number of ranks ({len(records)} files)"
    assert [r.layer_ids for r in records] == [expected_layers] * len(records), \
        f"{name}: asked for layers {expected_layers}, the files hold {[r.layer_ids for r in records]}"
    assert [entry["layers"] for entry in manifest] == [expected_layers] * len(manifest), \
        f"{name}: asked for layers {expected_layers}, the manifest lists {[e['layers'] for e in manifest]}"
    points = {str(len(r.token_ids)): {point: value.float() for point, value in dumped_points(r).items()}
              for r in records}
    errors = errors_against(float32, points)
    worst_rows = worst_row_errors(float32, points)
    record_result(f"tensor-parallel/{name}", {
        "args": list(extra_args), "ready_s": round(ready_s, 1), "layer_ids": expected_layers,
        "relative_error_vs_transformers_float32": errors,
        "worst_row_relative_error_vs_transformers_float32": worst_rows,
        "fusion_log_lines": [line[:300] for line in log.splitlines()
                             if FUSION_LOG.search(line) and "ServerArgs(" not in line][-10:],
    })
    for length in errors:
        print(f"{name}, {length} tokens: " + ", ".join(
            f"{point} {errors[length][point]:.3g} (worst row {worst_rows[length][point]:.3g})"
            for point in errors[length]))
    too_far = [f"{length} tokens, {point}: worst row {error:.3g} > {WORST_ROW_BOUND}"
               for length, by_point in worst_rows.items() for point, error in by_point.items()
               if error > WORST_ROW_BOUND]
    assert not too_far, f"{name}: {too_far}"
    return errors, points


def out_of_bounds(errors: Errors, transformers_bf16: Errors, tp1: Optional[Errors] = None,
                  bounds_of: Optional[Dict[str, str]] = None) -> List[str]:
    """Where the module docstring's rule fails: against transformers bf16, and against TP1 if given.
    `bounds_of` maps a point of `errors` to the point whose bounds it is held to (itself by default)."""
    failures = []
    for length, points in errors.items():
        for point, error in points.items():
            ruled_by = (bounds_of or {}).get(point, point)
            bounds = {"transformers bf16": MARGIN_OVER_TRANSFORMERS_BF16 * transformers_bf16[length][ruled_by]}
            if tp1 is not None:
                bounds["TP1"] = TP_FACTOR_OVER_TP1 * tp1[length][ruled_by]
            failures += [f"{length} tokens, {point}: {error:.3g} > {bound + ERROR_FLOOR:.3g} (by {by})"
                         for by, bound in bounds.items() if error > bound + ERROR_FLOOR]
    return failures


def assert_controls_fail(points: Points, float32, transformers_bf16: Errors, tp1: Optional[Errors] = None):
    """The rule must catch the bugs it is there for, on this launch's own values: for each
    pair of adjacent dumped layers a < b, the dump of a compared with float32 at a + 1 (a layer
    shifted by one), and the midpoint of a and b compared with float32 at b (with b = a + 1,
    the mean of two ranks' partial sums when layer a's output is not all-reduced), each held
    to the bounds of the point it is compared with, must break the rule at every prompt."""
    for length, dumped in points.items():
        layers = sorted(int(point) for point in dumped if point.isdigit())
        for a, b in zip(layers, layers[1:]):
            shifted = {length: {f"{a}+1": relative_error(dumped[str(a)], float32[length][str(a + 1)])}}
            midpoint = (dumped[str(a)] + dumped[str(b)]) / 2
            halfway = {length: {f"({a}+{b})/2": relative_error(midpoint, float32[length][str(b)])}}
            for control, ruled_by in ((shifted, str(a + 1)), (halfway, str(b))):
                [point] = control[length]
                failures = out_of_bounds(control, transformers_bf16, tp1, {point: ruled_by})
                assert failures, (f"{length} tokens: the control {point} ({control[length][point]:.3g} from "
                                  f"float32 at layer {ruled_by}) passes the rule: it cannot tell a wrong layer")
                print(f"control: {failures[0]}")


@pytest.fixture(scope="module")
def model():
    return ensure_model(layers=NUM_LAYERS, q_lora=True, widths="deepseek")


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return transformers_reference(model, prompts, "4-layers")


@pytest.fixture(scope="module")
def tp1(model, prompts, reference, tmp_path_factory):
    """TP1's errors, measured once for every TP configuration."""
    float32, _ = reference
    return dump_errors(model, prompts, float32, tmp_path_factory.mktemp("tp1"), "4-layers/tp1",
                       TP1_ARGS, LAYER_IDS, LAYERS)


def test_tp1_against_transformers(reference, tp1):
    float32, bf16_errors = reference
    errors, points = tp1
    assert not out_of_bounds(errors, bf16_errors)
    assert_controls_fail(points, float32, bf16_errors)


@pytest.mark.parametrize("name", list(TP_CONFIGURATIONS))
def test_tp_against_transformers(model, prompts, reference, tp1, tmp_path_factory, name):
    from scripts.dump_format import manifest_name, manifest_paths

    float32, bf16_errors = reference
    launch_dir = tmp_path_factory.mktemp(name)
    args = TP_CONFIGURATIONS[name]
    fusion = "--enable-flashinfer-allreduce-fusion" in args
    if fusion:  # count the fused all-reduce calls: did the fusion engage?
        args = [*args, "--forward-hooks", count_allreduce_fusion_spec(launch_dir)]
    errors, points = dump_errors(model, prompts, float32, launch_dir, f"4-layers/{name}", args, LAYER_IDS, LAYERS)
    tp1_errors, _ = tp1
    if fusion:
        counts = {path.name: json.loads(path.read_text()) for path in sorted(launch_dir.glob("fusion-rank*.json"))}
        record_result(f"tensor-parallel/4-layers/{name}/fusion-calls", counts)
        print(f"fused all-reduce + RMSNorm calls by rank: {counts}")
    assert not out_of_bounds(errors, bf16_errors, tp1_errors)
    assert_controls_fail(points, float32, bf16_errors, tp1_errors)
    # Under DP attention each data-parallel rank writes, each to its own manifest; the
    # prompts, sent one after another, go to the ranks in turn.
    writers = TP if "--enable-dp-attention" in TP_CONFIGURATIONS[name] else 1
    assert [Path(path).name for path in manifest_paths(str(launch_dir / "dump"))] == \
        [manifest_name(rank) for rank in range(writers)]


def test_61_layers_tp_default_layers(tmp_path_factory):
    """The seed's model depth at DeepSeek-V3's attention widths (hidden 256, 4 experts: ~65M
    parameters, 0.26 GB in float32, so transformers float32 fits GPU 0 with room to spare),
    dumping the default layers, the seed's [3, 31, 59]."""
    deep = ensure_model(layers=61, widths="deepseek")
    prompts = [random_prompt(500)]
    float32, bf16_errors = transformers_reference(deep, prompts, "61-layers")
    default_layers = [3, 31, 59]
    tp1_errors, tp1_points = dump_errors(deep, prompts, float32, tmp_path_factory.mktemp("tp1-61-layers"),
                                         "61-layers/tp1", TP1_ARGS, default_layers)
    errors, points = dump_errors(deep, prompts, float32, tmp_path_factory.mktemp(f"tp{TP}-61-layers"),
                                 f"61-layers/tp{TP}", ["--tp-size", str(TP), *TP1_ARGS], default_layers)
    assert not out_of_bounds(tp1_errors, bf16_errors)
    assert not out_of_bounds(errors, bf16_errors, tp1_errors)
    assert_controls_fail(tp1_points, float32, bf16_errors)
    assert_controls_fail(points, float32, bf16_errors, tp1_errors)


def test_a_rank_failing_in_warmup_stops_the_server(model, tmp_path):
    """The hook raises on rank FAILING_RANK in the warmup prefill. CUDA graphs are off: with them on, the
    warmup replays a captured graph, which runs no Python, so the hook would never run and the
    server would come up ready."""
    hooks = json.dumps([{"name": "fail", "target_modules": ["model.layers.1"],
                         "hook_factory": "tests.gpu.fault_hooks:raise_on_rank", "config": {"rank": FAILING_RANK}}])
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), SGLANG_HS_DUMP_LAYERS=LAYERS)
    args = ["--tp-size", str(TP), "--disable-cuda-graph", "--forward-hooks", hooks]
    started = time.monotonic()
    with Server(model, tmp_path / "server.log", env, args) as server:
        try:
            code = server.wait_exit(timeout=FAILURE_EXIT_TIMEOUT_S)
        except ServerFailed as still_running:
            what = "it came up ready: the hook never ran" if READY_LINE in server.log() else "it never came up"
            pytest.fail(f"{what}; {still_running}", pytrace=False)
        exit_s = time.monotonic() - started
        log = server.log()
    injected = f"injected failure on rank {FAILING_RANK}" in log
    record_result("tensor-parallel/rank-failing-in-warmup", {
        "args": args[:3], "exit_code": code, "exit_s": round(exit_s, 1), "injected_failure_logged": injected})
    assert code != 0, f"the server exited with 0:\n{log[-6000:]}"
    assert injected, f"the server exited ({code}) without the injected failure:\n{log[-6000:]}"
