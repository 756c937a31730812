"""SpecForge 0.2.0's own EAGLE-3 trainer on an export_specforge folder, as a user runs it:
`specforge train -c RUN.json` (offline: data.hidden_states_path names the export), then
`specforge export --to sglang`, which writes a draft folder SGLang serves.

What the trainer needs that a user must know:
- the draft config is given (SpecForge's generated one is never written, and it would carry the
  target's YaRN rope_scaling, which SpecForge trains with another scale than SGLang serves it);
- the target folder must have a weight index (SpecForge reads lm_head and the embeddings only
  through *.index.json); target_folder() makes one beside a single model.safetensors;
- the features are bf16 (its teacher head is), which every export here writes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

WEIGHTS = "model.safetensors"


def draft_config(target: Path, path: Path, layer_ids: Optional[List[int]]) -> Path:
    """A one-layer LlamaForCausalLMEagle3 for `target` in `path`/config.json, naming `layer_ids`
    (eagle_config.eagle_aux_hidden_state_layer_ids; None: none, SGLang's default)."""
    config = json.loads((target / "config.json").read_text())
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": config["hidden_size"], "target_hidden_size": config["hidden_size"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": config["max_position_embeddings"], "rope_theta": 10000.0, "rope_scaling": None,
        "vocab_size": config["vocab_size"], "draft_vocab_size": config["vocab_size"],
        "bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
        "pad_token_id": config.get("eos_token_id"), "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if layer_ids is not None:
        draft["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(draft, indent=2))
    return path / "config.json"


def write_weight_index(model: Path) -> None:
    """model.safetensors.index.json beside the one file of weights (SGLang and transformers
    read the folder as before)."""
    from safetensors import safe_open

    with safe_open(str(model / WEIGHTS), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {"total_size": (model / WEIGHTS).stat().st_size}, "weight_map": {n: WEIGHTS for n in names}}
    (model / f"{WEIGHTS}.index.json").write_text(json.dumps(index, indent=2))


def target_folder(model: Path, into: Path) -> Path:
    """`model` as SpecForge's trainer reads it: its files linked into `into`, with a weight index."""
    into.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        link = into / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    if not any(into.glob("*.index.json")):
        write_weight_index(into)
    return into


def run_config(name: str, target: Path, config: Path, features: Path, work: Path, max_length: int,
               training: Dict[str, object], seed: int) -> Path:
    run = {
        "run_id": name, "output_dir": str(work / "checkpoints"),
        "model": {"target_model_path": str(target), "draft_model_config": str(config), "torch_dtype": "bfloat16"},
        "data": {"hidden_states_path": str(features), "max_length": max_length, "cache_dir": str(work / "cache"),
                 "dataloader_num_workers": training.pop("dataloader_num_workers", 4)},
        "training": {**training, "seed": seed},
    }
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.json").write_text(json.dumps(run, indent=2))
    return work / "run.json"


def run_tool(args: List[str], log: Path, timeout: float, env: Optional[Dict[str, str]] = None) -> None:
    """Run a tool to its end (its output in `log`); raise with the log's tail if it fails."""
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            code = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(args[:4])} ... ended with {code} after {time.monotonic() - started:.0f} s:\n{tail}")


def train(run: Path, log: Path, timeout: float, launcher: Optional[List[str]] = None) -> None:
    """`specforge train -c RUN` (`launcher`: another way to start SpecForge's command line, such as
    the CPU smoke test's). Eager: SpecForge torch.compiles small helpers, which recompile as batch
    shapes change."""
    command = launcher or [sys.executable, "-m", "specforge.cli"]
    run_tool([*command, "train", "-c", str(run)], log, timeout, {"TORCHDYNAMO_DISABLE": "1"})


def export_draft(checkpoints: Path, config: Path, out: Path, log: Path, timeout: float) -> Path:
    """`specforge export --to sglang`: the trained draft as a folder SGLang serves."""
    run_tool([sys.executable, "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", str(checkpoints),
              "--draft-config", str(config), "--output-dir", str(out)], log, timeout)
    return out


def losses(log: Path) -> List[float]:
    """The training loss of every logged step, in order (SpecForge logs `step N: {..., 'loss': x, ...}`)."""
    import ast

    found = []
    for line in log.read_text(errors="replace").splitlines():
        head, _, metrics = line.partition(": {")
        if head.strip().split(" ")[-2:-1] == ["step"] and metrics:
            found.append(float(ast.literal_eval("{" + metrics)["loss"]))
    return found
