"""The independent oracle: torch forward hooks that SGLang attaches with --forward-hooks.

They record, on every forward, SGLang's own values at the points the dump captures, by a
different path than the patched capture code:
- `model.embed_tokens`: the embedding output (the stream entering layer 0);
- `model.layers.{i}`: returns (hidden_states, residual), whose sum is the residual stream
  entering layer i+1 (SGLang defers the residual add into the next layer's norm);
- `model.norm`: the final normed hidden state the LM head reads.
"""

import itertools
import json
from pathlib import Path
from typing import Dict, List

import torch


def record_output(config):
    out_dir = Path(config["dir"])
    name = config["name"]
    calls = itertools.count()

    def hook(module, inputs, output):
        if config["kind"] == "layer":
            hidden_states, residual = output
            value = hidden_states if residual is None else hidden_states + residual
        elif isinstance(output, tuple):
            value = output[0]
        else:
            value = output
        torch.save(value.detach().to("cpu").clone(), out_dir / f"{name}.{next(calls):05d}.pt")

    return hook


def hook_specs(out_dir: Path, num_layers: int) -> str:
    """The --forward-hooks JSON; target names are exact (a pattern would match submodules)."""
    targets = [("embed", "model.embed_tokens", "tensor"), ("norm", "model.norm", "tensor")]
    targets += [(f"layer{i}", f"model.layers.{i}", "layer") for i in range(num_layers)]
    return json.dumps([
        {"name": name, "target_modules": [module], "hook_factory": "tests.server.oracle_hooks:record_output",
         "config": {"dir": str(out_dir), "name": name, "kind": kind}}
        for name, module, kind in targets
    ])


def residual_streams(out_dir: Path, num_layers: int, num_tokens: int) -> Dict[str, torch.Tensor]:
    """{"0".."L": stream entering layer i (L: last layer's output), "last": final normed state},
    taken from the one forward that prefilled exactly num_tokens rows."""
    def only_call(name: str) -> torch.Tensor:
        matches: List[torch.Tensor] = [
            t for t in (torch.load(p) for p in sorted(out_dir.glob(f"{name}.*.pt"))) if t.shape[0] == num_tokens
        ]
        assert len(matches) == 1, f"{name}: expected one forward of {num_tokens} rows, found {len(matches)}"
        return matches[0]

    streams = {"0": only_call("embed"), "last": only_call("norm")}
    for i in range(num_layers):
        streams[str(i + 1)] = only_call(f"layer{i}")
    return streams
