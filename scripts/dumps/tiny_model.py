"""Generate reduced-layer DeepSeek-V3 models locally: random weights, fixed seed, no model hub.

    python -m scripts.dumps.tiny_model --layers 3 [--no-q-lora] [--widths cpu|deepseek]

prints the model folder (cached under .cache/models/). `cpu` widths are the smallest
that SGLang's CPU path runs; `deepseek` keeps DeepSeek-V3's real attention widths
(kv_lora_rank 512, qk_rope_head_dim 64), which SGLang's Triton MLA kernels on the GPU
require, and can take DeepSeek-V3's hidden size for compute-bound benchmarks.
"""

import argparse
import json
import math
from pathlib import Path
from typing import Optional

from scripts.paths import CACHE_DIR

MODEL_CACHE = CACHE_DIR / "models"
SEED = 20261129
ROUTER_LOGIT_STD = 3.0
GENERATOR_VERSION = 2  # part of the cache name: a change here regenerates models

WIDTHS = {
    "cpu": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96,
        kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        n_routed_experts=8, num_experts_per_tok=2,
    ),
    "deepseek": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=4, num_experts_per_tok=2,
    ),
}

# Keys DeepSeek's published config.json has and transformers' config class does not
# write; SGLang reads them.
SGLANG_KEYS = dict(
    moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1,
    num_nextn_predict_layers=0,
)
# SGLang's CPU rotary path requires rope_scaling; the real models use yarn.
YARN = {
    "type": "yarn", "rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
}


def model_name(layers: int, q_lora: bool, widths: str, hidden_size: Optional[int]) -> str:
    hidden = f"-h{hidden_size}" if hidden_size else ""
    return f"deepseek-v3-{widths}{hidden}-L{layers}-{'q' if q_lora else 'noq'}lora-v{GENERATOR_VERSION}"


def ensure_model(layers: int = 3, q_lora: bool = True, widths: str = "cpu",
                 hidden_size: Optional[int] = None, cache: Path = MODEL_CACHE) -> Path:
    """The model folder, generated on first use, with the tiny tokenizer and its chat
    template (DeepSeek-V3's, without generation markers)."""
    from scripts.dumps.tiny_tokenizer import has_tokenizer, write_tokenizer

    path = cache / model_name(layers, q_lora, widths, hidden_size)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        if not has_tokenizer(path):  # generated before models had a tokenizer
            write_tokenizer(path)
        return path
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shape = dict(WIDTHS[widths])
    if not q_lora:
        shape["q_lora_rank"] = None
    if hidden_size:
        # DeepSeek-V3's proportions (7168: intermediate 18432, moe_intermediate 2048,
        # q_lora_rank 1536), 16 heads and 8 routed experts: compute-bound like the real model.
        shape.update(
            hidden_size=hidden_size, intermediate_size=hidden_size * 18432 // 7168,
            moe_intermediate_size=hidden_size * 2048 // 7168,
            q_lora_rank=hidden_size * 1536 // 7168 if q_lora else None,
            num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8,
        )
    config = DeepseekV3Config(
        vocab_size=1024, num_hidden_layers=layers, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=16384, rope_scaling=YARN, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", **shape,
    )
    torch.manual_seed(SEED)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        with torch.no_grad():
            gate.e_score_correction_bias.zero_()
            # Random init leaves router logits nearly tied (std ~0.3), so bf16 rounding in
            # one engine or another flips expert choices; trained routers are decisive.
            # Logits of std ~3 make comparisons between engines measure hidden states,
            # not tie-breaking, without saturating the sigmoid scores.
            gate.weight.mul_(ROUTER_LOGIT_STD / (config.initializer_range * math.sqrt(config.hidden_size)))
    staging = path.with_name(path.name + ".tmp")
    model.save_pretrained(staging, safe_serialization=True)
    config_path = staging / "config.json"
    saved = json.loads(config_path.read_text())
    saved.update(SGLANG_KEYS)
    saved["architectures"] = ["DeepseekV3ForCausalLM"]
    config_path.write_text(json.dumps(saved, indent=2))
    write_tokenizer(staging)
    staging.rename(path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--no-q-lora", action="store_true", help="q_lora_rank unset (DeepSeek-V2-Lite style)")
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="cpu")
    parser.add_argument("--hidden-size", type=int, default=None, help="e.g. 7168, DeepSeek-V3's")
    args = parser.parse_args(argv)
    print(ensure_model(args.layers, not args.no_q_lora, args.widths, args.hidden_size))


if __name__ == "__main__":
    main()
