"""Train/serve parity: what SGLang's EAGLE-3 feeds a draft equals what the dump writes.

One server serves the target with an EAGLE-3 draft (SGLang's LlamaForCausalLMEagle3 layout,
weights drawn by SGLang's dummy loader); a forward hook on the draft's input projection
(`model.fc`) records the target features it is fed, [T, K*H], for a prompt's prefill. A
second server (speculative decoding is refused with dumping on) dumps the same prompt, with
the layers the dump's own mapping says that draft config is fed. The dumped rows, side by
side in ascending layer order, must equal the hook's input, and the file must name the
draft's ids among the configs it is fed by.

Shared by tests/server (CPU, where SGLang's CPU path serves EAGLE-3) and tests/gpu.
"""

import json
import random
import re
from pathlib import Path
from typing import List, Optional

import pytest
import torch

from scripts.dump_format import load_dump
from scripts.dumps.server import Server, ServerFailed, runtime_env, wait_for_manifest

PROMPT_LEN = 41  # a length no warmup or draft step has
# Why this release cannot serve EAGLE-3 here, once a server has shown it: the other cases
# skip without starting another.
_cannot_serve: List[str] = []


def write_draft(path: Path, target: Path, layer_ids: Optional[List[int]]) -> Path:
    """A one-layer EAGLE-3 draft config for `target` (no weights: SGLang's dummy loader
    draws them), naming `layer_ids` (None: none, SGLang's default)."""
    config = json.loads((target / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": hidden // heads, "vocab_size": config["vocab_size"],
        "draft_vocab_size": config["vocab_size"], "max_position_embeddings": config["max_position_embeddings"],
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if layer_ids is not None:
        draft["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(draft, indent=1))
    return path


def record_fc_input(config):
    """Forward hook factory: saves each input of the draft's fc (the features it is fed)."""
    out = Path(config["dir"])
    count = iter(range(1 << 30))

    def hook(module, inputs, output):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # a CUDA graph being captured: no copy to the host (its replays run no hook)
        torch.save(inputs[0].detach().to("cpu").clone(), out / f"fc.{next(count):05d}.pt")

    return hook


def record_layers_to_capture(config):
    """Forward hook factory on `model` (the target's decoder, and the draft's): writes the
    layers the target captures for the draft, as SGLang's own EAGLE-3 setup set them."""
    out = Path(config["dir"]) / "layers_to_capture.json"

    def hook(module, inputs, output):
        if getattr(module, "layers_to_capture", None) is not None and not out.exists():
            out.write_text(json.dumps(sorted(module.layers_to_capture)))

    return hook


def hook_spec(out: Path) -> str:
    return json.dumps([
        {"name": "draft_fc", "target_modules": ["model.fc"],
         "hook_factory": "tests.server.eagle3_parity:record_fc_input", "config": {"dir": str(out)}},
        {"name": "target_capture", "target_modules": ["model"],
         "hook_factory": "tests.server.eagle3_parity:record_layers_to_capture", "config": {"dir": str(out)}},
    ])


def eagle3_args(draft: Path) -> List[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "1",
            "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2", "--grammar-backend", "none"]


def served_features(target: Path, draft: Path, prompt: List[int], work: Path, extra_args=()):
    """The features the draft is fed for the prompt's prefill, recorded by the fc hook, and
    the layers the target captured for it (transformers' convention, ascending)."""
    if _cannot_serve:
        pytest.skip(_cannot_serve[0])
    out = work / "fc"
    out.mkdir(parents=True)
    args = [*eagle3_args(draft), "--forward-hooks", hook_spec(out), *extra_args]
    with Server(target, work / "eagle3.log", runtime_env(), args) as server:
        try:
            server.wait_ready()
        except ServerFailed as failed:
            error = [line for line in server.log().splitlines() if re.search(r"Error|error:", line)]
            _cannot_serve.append(f"SGLang {release()} cannot serve EAGLE-3 here: {(error or [str(failed)])[-1].strip()}")
            pytest.skip(_cannot_serve[0])
        server.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    fed = [t for t in (torch.load(p) for p in sorted(out.glob("fc.*.pt"))) if t.shape[0] == len(prompt)]
    assert len(fed) == 1, f"expected one draft forward of {len(prompt)} rows, found {len(fed)}"
    return fed[0], json.loads((out / "layers_to_capture.json").read_text())


def dumped_rows(target: Path, layers: List[int], prompt: List[int], work: Path, extra_args=()):
    dump_dir = work / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_LAYERS=",".join(map(str, layers)))
    with Server(target, work / "dump.log", env, list(extra_args)) as server:
        server.wait_ready()
        server.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        [entry] = wait_for_manifest(dump_dir, 1)
    return load_dump(str(dump_dir / entry["file"]))


def release() -> str:
    from sglang.version import __version__

    return __version__


def check_parity(target: Path, draft_ids: Optional[List[int]], work: Path, extra_args=(), bound: float = 0.0):
    """The whole check for one draft config; returns (fed layers, worst relative error).
    The layers to dump are the ones SGLang's EAGLE-3 setup made the target capture (read in
    the server, by a hook); the dump's metadata must name the draft's ids for them, which
    the dumping server computes by its own mapping."""
    prompt = random.Random(PROMPT_LEN).sample(range(5, 1000), PROMPT_LEN)
    draft = write_draft(work / "draft", target, draft_ids)
    served, fed = served_features(target, draft, prompt, work, extra_args)
    # Dumped in an order of our own: the file keeps it, the draft is fed ascending.
    record = dumped_rows(target, list(reversed(fed)), prompt, work, extra_args)
    assert record.token_ids.tolist() == prompt
    assert draft_ids in record.eagle3_draft_layer_ids, (draft_ids, record.eagle3_draft_layer_ids)
    side_by_side = record.hidden_states[:, [record.layer_ids.index(layer) for layer in fed]].flatten(1)
    assert served.shape == side_by_side.shape
    in_wrong_order = record.hidden_states[:, [record.layer_ids.index(layer) for layer in fed][::-1]].flatten(1)
    if bound == 0.0:
        assert torch.equal(served.to(side_by_side.dtype), side_by_side), "the dump is not what the draft is fed"
        assert not torch.equal(served.to(side_by_side.dtype), in_wrong_order)  # the check can fail
        return fed, 0.0
    error = ((served.float() - side_by_side.float()).norm() / side_by_side.float().norm()).item()
    assert error <= bound, f"relative error {error:.3g} over {bound}"
    # The layers in another order must fail the same bound (the bound can tell).
    assert ((served.float() - in_wrong_order.float()).norm() / in_wrong_order.float().norm()).item() > bound
    return fed, error
