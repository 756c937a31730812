"""Generate reduced-layer DeepSeek-V3 models locally: random weights, fixed seed, no model hub.

    python -m scripts.dumps.tiny_model --layers 3 [--no-q-lora] [--widths cpu|deepseek] [--kimi-k25 [--int4 [--dequantized]]]

prints the model folder (cached under .cache/models/). `cpu` widths are the smallest
that SGLang's CPU path runs; `deepseek` keeps DeepSeek-V3's real attention widths
(kv_lora_rank 512, qk_rope_head_dim 64), which SGLang's Triton MLA kernels on the GPU
require, and can take DeepSeek-V3's hidden size for compute-bound benchmarks.
`--kimi-k25` wraps that model as the text model of a reduced Kimi-K2.5; `--int4` stores it
as Moonshot's INT4 release does (routed experts pack-quantized to 4 bits, scripts/dumps/int4_weights.py),
and `--dequantized` prints instead the bf16 DeepSeek-V3 its packed weights decode to, which
transformers runs as the reference.
"""

import argparse
import fcntl
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
    # The cpu widths with eight heads, which every tensor-parallel size up to 8 divides: SGLang
    # pads heads that do not divide on the CPU (configs/update_config.py), and a padded
    # 4-head model at TP8 dumped a row 0.1 away from TP1's (a token that switched experts).
    "cpu-8heads": dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96,
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
    cache.mkdir(parents=True, exist_ok=True)
    # Several processes may ask for one model at once (benchmarks run side by side): one
    # generates it, the others wait and use it.
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").exists() and any(path.glob("*.safetensors")):
            if not has_tokenizer(path):  # generated before models had a tokenizer
                write_tokenizer(path)
            return path
        return _generate(path, layers, q_lora, widths, hidden_size)


def _generate(path: Path, layers: int, q_lora: bool, widths: str, hidden_size: Optional[int]) -> Path:
    import torch
    from scripts.dumps.tiny_tokenizer import write_tokenizer
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
    save_for_sglang(model, staging)
    write_tokenizer(staging)
    staging.rename(path)
    return path


def save_for_sglang(model, path: Path) -> None:
    """A transformers DeepSeek-V3 saved as SGLang loads it: its config with the keys DeepSeek's
    published config.json has and transformers does not write."""
    model.save_pretrained(path, safe_serialization=True)
    config_path = path / "config.json"
    saved = json.loads(config_path.read_text())
    saved.update(SGLANG_KEYS)
    saved["architectures"] = ["DeepseekV3ForCausalLM"]
    config_path.write_text(json.dumps(saved, indent=2))


# Kimi-K2.5's vision tower (MoonViT) and projector at their smallest. Text prompts never run
# them and SGLang loads only the weights a checkpoint holds, so the checkpoint has none.
# SGLang's tower reads hidden_size, its projector vt_hidden_size (Kimi-K2.5's own name).
# Eight heads: SGLang splits the tower's attention heads over the tensor-parallel ranks
# (VisionAttention), so a TP8 server needs a number that 8 divides.
KIMI_VISION = dict(
    num_hidden_layers=1, hidden_size=64, vt_hidden_size=64, intermediate_size=128,
    num_attention_heads=8, patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8,
    init_pos_emb_time=4, merge_kernel_size=[2, 2], mm_hidden_size=64,
)
# The media settings of Kimi-K2.5's preprocessor_config.json, on the tower's patches.
KIMI_MEDIA = dict(
    patch_size=KIMI_VISION["patch_size"], merge_kernel_size=KIMI_VISION["merge_kernel_size"],
    in_patch_limit=16384, patch_limit_on_one_side=512, image_mean=[0.5] * 3, image_std=[0.5] * 3,
)
KIMI_PROCESSOR = Path(__file__).with_name("tiny_kimi_processor.py")
KIMI_VISION_VERSION = 2  # part of the cache name: a change to the tower regenerates the model


def ensure_kimi_model(layers: int = 3, q_lora: bool = True, widths: str = "cpu",
                      hidden_size: Optional[int] = None, cache: Path = MODEL_CACHE, int4: bool = False) -> Path:
    """A reduced Kimi-K2.5 (KimiK25ForConditionalGeneration), generated on first use: the
    tiny DeepSeek-V3 `ensure_model` makes of these arguments as its text model, its weights under
    `language_model.` as in Kimi-K2.5's checkpoint, a one-layer vision tower, the tiny
    tokenizer, and a processor of its own (tiny_kimi_processor.py) that SGLang loads with
    --trust-remote-code, as Kimi-K2.5's. With `int4`, in Moonshot's INT4 release format: the
    routed experts packed by compressed-tensors, the text config's quantization_config saying so."""
    from scripts.dumps.tiny_tokenizer import write_tokenizer

    text_model = ensure_model(layers, q_lora, widths, hidden_size, cache)
    path = cache / f"kimi-k25-{'int4-' if int4 else ''}vision{KIMI_VISION_VERSION}-{text_model.name}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    from safetensors.torch import load_file, save_file

    staging = path.with_name(path.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    weights = {}
    for file in sorted(text_model.glob("*.safetensors")):
        weights.update({f"language_model.{name}": tensor for name, tensor in load_file(file).items()})
    text_config = json.loads((text_model / "config.json").read_text())
    if int4:
        from scripts.dumps.int4_weights import QUANTIZATION_CONFIG, pack

        weights = pack(weights)
        text_config["quantization_config"] = QUANTIZATION_CONFIG
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text_config, "vision_config": dict(KIMI_VISION, text_hidden_size=text_config["hidden_size"]),
        "torch_dtype": "bfloat16",
    }
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(staging)
    (staging / KIMI_PROCESSOR.name).write_text(KIMI_PROCESSOR.read_text())
    processor = {"processor_class": "KimiK25Processor", "media_proc_cfg": KIMI_MEDIA,
                 "auto_map": {"AutoProcessor": f"{KIMI_PROCESSOR.stem}.KimiK25Processor"}}
    (staging / "processor_config.json").write_text(json.dumps(processor, indent=2))
    staging.rename(path)
    return path


def ensure_dequantized_int4_model(layers: int = 3, q_lora: bool = True, widths: str = "cpu",
                                  hidden_size: Optional[int] = None, cache: Path = MODEL_CACHE) -> Path:
    """The text model of `ensure_kimi_model(..., int4=True)` as a bf16 DeepSeek-V3 that
    transformers loads: its packed experts decoded by compressed-tensors, everything else as
    stored. Generated on first use."""
    from safetensors.torch import load_file, save_file
    from scripts.dumps.int4_weights import decode
    from scripts.dumps.tiny_tokenizer import write_tokenizer

    int4_model = ensure_kimi_model(layers, q_lora, widths, hidden_size, cache, int4=True)
    path = cache / f"{int4_model.name}-dequantized"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    staging = path.with_name(path.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    stored = load_file(int4_model / "model.safetensors")
    weights = {name.removeprefix("language_model."): tensor for name, tensor in decode(stored).items()}
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    text_config = json.loads((int4_model / "config.json").read_text())["text_config"]
    del text_config["quantization_config"]
    (staging / "config.json").write_text(json.dumps(text_config, indent=2))
    write_tokenizer(staging)
    staging.rename(path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--no-q-lora", action="store_true", help="q_lora_rank unset (DeepSeek-V2-Lite style)")
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="cpu")
    parser.add_argument("--hidden-size", type=int, default=None, help="e.g. 7168, DeepSeek-V3's")
    parser.add_argument("--kimi-k25", action="store_true", help="a reduced Kimi-K2.5 with that text model")
    parser.add_argument("--int4", action="store_true", help="with --kimi-k25: in Moonshot's INT4 release format")
    parser.add_argument("--dequantized", action="store_true",
                        help="with --int4: the bf16 DeepSeek-V3 the INT4 model's weights decode to")
    args = parser.parse_args(argv)
    if args.int4 and not args.kimi_k25:
        parser.error("--int4 is a format of the reduced Kimi-K2.5: give --kimi-k25 with it")
    if args.dequantized and not args.int4:
        parser.error("--dequantized is the decoded twin of an INT4 model: give --kimi-k25 --int4 with it")
    shape = (args.layers, not args.no_q_lora, args.widths, args.hidden_size)
    if args.dequantized:
        print(ensure_dequantized_int4_model(*shape))
    elif args.kimi_k25:
        print(ensure_kimi_model(*shape, int4=args.int4))
    else:
        print(ensure_model(*shape))


if __name__ == "__main__":
    main()
