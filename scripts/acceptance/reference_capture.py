"""The anchor's features, made without SGLang: the target's own forward in transformers
(`output_hidden_states`) over the same records the dump holds, written in SpecForge's offline
layout exactly as export_specforge writes ours (input_ids, loss_mask, hidden_state: the final
normed state, aux_hidden_state: the layers side by side in ascending order).

SpecForge 0.2.0's own capture (its offline_capture package) is driven by a script of its
repository that its wheel does not install, so the anchor a user can run from the wheel alone is
this one. Id i is transformers' hidden_states[i], the residual stream entering layer i: the
dump's convention, so the same ids name the same layers.
"""

import json
from pathlib import Path
from typing import List

from scripts.dumps.export_specforge import sample_path, save


def capture(target: Path, records: Path, out: Path, layers: List[int], max_tokens: int) -> dict:
    """Every record of `records` (JSON Lines of {"id", "text"}) as one .ckpt file in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).to(device).eval()
    if any(not 0 <= layer < model.config.num_hidden_layers for layer in layers):
        raise ValueError(f"layers {layers}: ids below L = {model.config.num_hidden_layers} only")
    layers = sorted(layers)
    samples = tokens = 0
    with open(records, encoding="utf-8") as lines, torch.no_grad():
        for idx, line in enumerate(lines):
            # generate's plain text encoding (chat.ChatEncoder.encode_text), cut as SpecForge reads it
            ids = tokenizer(json.loads(line)["text"])["input_ids"][:max_tokens]
            forward = model.model(torch.tensor([ids], device=device), output_hidden_states=True)
            aux = torch.cat([forward.hidden_states[layer][0] for layer in layers], dim=-1)
            path = sample_path(out, idx)
            path.parent.mkdir(parents=True, exist_ok=True)
            save({"input_ids": torch.tensor(ids, dtype=torch.long),
                  "loss_mask": torch.ones(len(ids), dtype=torch.long),
                  "hidden_state": forward.last_hidden_state.to("cpu"),
                  "aux_hidden_state": aux.unsqueeze(0).to("cpu")}, path, compress=False)
            samples += 1
            tokens += len(ids)
    return {"samples": samples, "tokens": tokens, "layers": layers, "device": device}
