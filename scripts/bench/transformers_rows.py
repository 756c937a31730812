"""What transformers computes on a model's weights for given tokens, as a dump holds it: per
token list, the stream entering each decoder layer (layer id i < L), the last layer's output
before the final norm (id L) and the normed output ("last"). The reference the answers suite
holds decode and prefill rows against, and the GPU tests (tests/gpu) hold dumps against: in
float32 the value a bf16 engine approximates, in bf16 what bf16 itself allows."""

from pathlib import Path
from typing import Dict, List, Sequence

import torch


def transformers_rows(model: Path, token_lists: Sequence[List[int]], dtype: torch.dtype,
                      device: str) -> List[Dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    num_layers = len(hf.model.layers)
    last_layer = {}
    handle = hf.model.layers[-1].register_forward_hook(lambda module, inputs, output: last_layer.__setitem__(
        "output", output[0] if isinstance(output, tuple) else output))
    rows = []
    try:
        with torch.no_grad():
            for tokens in token_lists:
                out = hf.model(torch.tensor([tokens], device=device), output_hidden_states=True)
                points = {str(i): out.hidden_states[i][0] for i in range(num_layers)}
                points[str(num_layers)] = last_layer["output"][0]
                points["last"] = out.last_hidden_state[0]
                rows.append({name: value.float().cpu() for name, value in points.items()})
    finally:
        handle.remove()
        del hf
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
