"""Tensor parallelism (at least 2 GPUs): the dump under TP equals TP1, one file per request,
and a rank that fails during warmup stops the server instead of hanging it.

Run by `bash scripts/bench/gpu/run_checks.sh tests/gpu/test_tensor_parallel.py` on a machine with
2 or more GPUs; skipped elsewhere.
"""

import json
import random

import pytest
import torch

from scripts.dumps.server import Server, has_gpu, runtime_env, wait_for_manifest
from scripts.dumps.tiny_model import ensure_model

pytestmark = pytest.mark.skipif(not has_gpu() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")

NUM_LAYERS = 4
LAYERS = "0,1,2,3,4"
PROMPT_LENGTHS = (7, 100, 700, 3000)  # under and over the 2048-token all-reduce fusion limit


@pytest.fixture(scope="module")
def model():
    return ensure_model(layers=NUM_LAYERS, q_lora=True, widths="deepseek")


def random_prompt(length: int):
    rng = random.Random(length)
    return [rng.randrange(5, 1000) for _ in range(length)]


def dump_prompts(model, tmp_path, name, extra_args):
    from sglang.srt.managers.hidden_states_dump import load_dump

    dump_dir = tmp_path / name
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_LAYERS=LAYERS)
    prompts = [random_prompt(n) for n in PROMPT_LENGTHS]
    with Server(model, tmp_path / f"{name}.log", env, extra_args) as server:
        server.wait_ready(timeout=500)
        for prompt in prompts:
            server.generate(prompt, max_new_tokens=2)
        manifest = wait_for_manifest(dump_dir, len(prompts))
    assert len(manifest) == len(prompts), "one file per request, whatever the number of ranks"
    records = [load_dump(str(dump_dir / entry["file"])) for entry in manifest]
    return {tuple(r.token_ids.tolist()): r for r in records}


@pytest.fixture(scope="module")
def tp1(model, tmp_path_factory):
    return dump_prompts(model, tmp_path_factory.mktemp("tp1"), "tp1", [])


@pytest.mark.parametrize("extra_args", [
    ["--tp-size", "2"],
    ["--tp-size", "2", "--enable-flashinfer-allreduce-fusion"],
    ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
], ids=["tp2", "tp2-allreduce-fusion", "tp2-dp-attention"])
def test_tp2_dump_equals_tp1(model, tp1, tmp_path, extra_args):
    tp2 = dump_prompts(model, tmp_path, "tp2", extra_args)
    assert tp2.keys() == tp1.keys()
    errors = {}
    for tokens, reference in tp1.items():
        record = tp2[tokens]
        for k, layer in enumerate(json.loads(record.metadata["layer_ids"])):
            a, b = record.hidden_states[:, k].float(), reference.hidden_states[:, k].float()
            errors[(len(tokens), layer)] = ((a - b).norm() / b.norm()).item()
    print(json.dumps({f"{n} tokens, layer {l}": e for (n, l), e in errors.items()}, indent=1))
    assert max(errors.values()) <= 1e-2, errors


def test_a_rank_failing_in_warmup_stops_the_server(model, tmp_path):
    hooks = json.dumps([{"name": "fail", "target_modules": ["model.layers.1"],
                         "hook_factory": "tests.gpu.fault_hooks:raise_on_rank", "config": {"rank": 1}}])
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), SGLANG_HS_DUMP_LAYERS=LAYERS)
    with Server(model, tmp_path / "server.log", env, ["--tp-size", "2", "--forward-hooks", hooks]) as server:
        code = server.wait_exit(timeout=400)
        log = server.log()
    assert code != 0
    assert "injected failure on rank 1" in log
