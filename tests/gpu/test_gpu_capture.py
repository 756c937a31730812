"""On a GPU: the patched server with CUDA graphs on (the default) and off dumps the values
transformers computes on the same weights (relative error at most 1e-2 per layer), and so it
does with every forward's rows crossing to the host in slices of a row (the copier's slices
are 16 MiB, more than this prompt's rows).

Run by scripts/bench/gpu/run_checks.sh on the GPU machine; skipped where there is no GPU.
GPU models keep DeepSeek-V3's attention widths: SGLang's Triton MLA kernels need them.
"""

import json
import os
import random
import time
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch

from scripts.dumps.server import Server, has_gpu, runtime_env, wait_for_manifest
from scripts.dumps.tiny_model import ensure_model
from scripts.bench.copier_hooks import slices_hook
from scripts.bench.transformers_rows import transformers_rows

pytestmark = pytest.mark.skipif(not has_gpu(), reason="needs a GPU")

NUM_LAYERS = 4
PROMPT_LEN = 100
RESULTS = Path(os.environ.get("GPU_RESULTS", "gpu-results.json"))


@pytest.fixture(scope="module")
def model():
    return ensure_model(layers=NUM_LAYERS, q_lora=True, widths="deepseek")


def transformers_streams(model: Path, prompts: Sequence[List[int]],
                         dtype: torch.dtype) -> Dict[str, Dict[str, torch.Tensor]]:
    """transformers on the same weights on the GPU (scripts/bench/transformers_rows.py), per
    prompt length: the stream entering each layer, the last layer's output before the final
    norm (id L), and the normed output under the dump's name for it, last_hidden_state."""
    return {str(len(prompt)): {("last_hidden_state" if name == "last" else name): value for name, value in points.items()}
            for prompt, points in zip(prompts, transformers_rows(model, prompts, dtype, "cuda"))}


@pytest.fixture(scope="module")
def reference(model):
    """transformers on the same weights on the GPU, in float32 (the value SGLang's bf16
    computation approximates) and in bf16."""
    prompt = random.Random(PROMPT_LEN).sample(range(5, 1000), PROMPT_LEN)
    references = {str(dtype).replace("torch.", ""): transformers_streams(model, [prompt], dtype)[str(PROMPT_LEN)]
                  for dtype in (torch.float32, torch.bfloat16)}
    return prompt, references


def relative_error(actual, expected) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


def record_result(name: str, result: dict) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[name] = result
    RESULTS.write_text(json.dumps(results, indent=1))


@pytest.mark.parametrize("cuda_graphs, slice_bytes", [(True, None), (False, None), (False, 4096)],
                         ids=["cuda-graphs", "no-cuda-graph", "no-cuda-graph-row-slices"])
def test_dump_equals_transformers(model, reference, tmp_path, cuda_graphs, slice_bytes):
    prompt, references = reference
    layers = list(range(NUM_LAYERS + 1))
    dump_dir = tmp_path / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_LAYERS=",".join(map(str, layers)))
    extra = [] if cuda_graphs else ["--disable-cuda-graph"]
    if slice_bytes:
        extra += ["--forward-hooks", json.dumps([slices_hook(slice_bytes)])]
    log = tmp_path / "server.log"
    started = time.monotonic()
    with Server(model, log, env, extra) as server:
        server.wait_ready(timeout=400)
        ready_s = time.monotonic() - started
        response = server.generate(prompt, max_new_tokens=4)
        manifest = wait_for_manifest(dump_dir, 1)
        text = server.log()
    from scripts.dump_format import load_dump

    assert len(manifest) == 1
    record = load_dump(str(dump_dir / manifest[0]["file"]))
    assert record.token_ids.tolist() == prompt
    dumped = {str(layer): record.hidden_states[:, k] for k, layer in enumerate(layers)}
    dumped["last_hidden_state"] = record.last_hidden_state
    errors = {dtype: {name: relative_error(value, streams[name]) for name, value in dumped.items()}
              for dtype, streams in references.items()}
    name = ("cuda-graphs" if cuda_graphs else "no-cuda-graph") + ("-row-slices" if slice_bytes else "")
    record_result(name, {
        "relative_error_vs_transformers": errors, "ready_s": round(ready_s, 1),
        "output_ids": response["output_ids"],
        "graph_lines": [line for line in text.splitlines() if "cuda graph:" in line][-3:],
    })
    if slice_bytes:
        assert f"in slices of at most {slice_bytes} bytes" in text
    if cuda_graphs:
        assert "cuda graph: True" in text, "the warmup prefill should replay a prefill CUDA graph"
    for name, error in errors["float32"].items():
        assert error <= 1e-2, f"{name}: relative error {error:.3g} against transformers in float32 ({errors})"
