"""The acceptance target: a small DeepSeek-V3 (MLA attention, MoE layers, our layer layout)
trained on the corpus (scripts/acceptance/corpus.py) with a tokenizer trained for it, so that
a draft has a real distribution to learn.

    python -m scripts.acceptance.target OUT_DIR [--steps N] [--deadline-s S]

writes OUT_DIR/model (a Hugging Face folder SGLang serves: bf16 safetensors, config.json with
the keys SGLang reads, tokenizer) and OUT_DIR/target.json (the recipe, the corpus it read, the
loss curve and the held-out perplexity of the bf16 weights as saved). Everything is fixed by
SEED: the tokenizer, the initial weights, the order of the batches. The attention widths are
DeepSeek-V3's own (kv_lora_rank 512, qk_rope_head_dim 64), which SGLang's MLA kernels on the
GPU require; the rest is small enough that the weights travel with the GPU bundle.
"""

import argparse
import json
import math
import time
from pathlib import Path
from typing import Dict, List

from scripts.acceptance import corpus
from scripts.dumps.tiny_model import YARN, save_for_sglang
from scripts.dumps.tiny_tokenizer import EOS, write_tokenizer

SEED = 20261204
VOCAB_SIZE = 4096
SEQ_LEN = 512
NUM_LAYERS = 8  # EAGLE-3's default layers [3, L//2+1, L-2] are then [3, 5, 6]
SHAPE = dict(
    hidden_size=192, intermediate_size=512, moe_intermediate_size=96,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
)
RECIPE = dict(steps=3000, batch=64, lr=3e-3, warmup=200, min_lr_fraction=0.1, weight_decay=0.1,
              betas=(0.9, 0.95), grad_clip=1.0, eval_batches=64)


def config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE, num_hidden_layers=NUM_LAYERS, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=16384,
        rope_scaling=YARN, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
        **SHAPE,
    )


def train_tokenizer():
    from scripts.dumps.tiny_tokenizer import train

    return train((f.text for f in corpus.split("train")), vocab_size=VOCAB_SIZE)


def encode_split(tokenizer, name: str):
    """The split as one stream of token ids, each file followed by the end-of-text token."""
    import torch

    eos = tokenizer.token_to_id(EOS)
    stream: List[int] = []
    for encoding in tokenizer.encode_batch([f.text for f in corpus.split(name)], add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.int64)


def learning_rate(step: int) -> float:
    if step < RECIPE["warmup"]:
        return RECIPE["lr"] * (step + 1) / RECIPE["warmup"]
    progress = (step - RECIPE["warmup"]) / max(1, RECIPE["steps"] - RECIPE["warmup"])
    floor = RECIPE["min_lr_fraction"]
    return RECIPE["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def held_out_perplexity(model, stream, device, batches: int) -> Dict[str, float]:
    """Perplexity of every token of the first `batches` x batch windows of the held-out split."""
    import torch
    import torch.nn.functional as F

    windows = stream[: (len(stream) - 1) // SEQ_LEN * SEQ_LEN + 1]
    starts = list(range(0, len(windows) - 1, SEQ_LEN))[: batches * RECIPE["batch"]]
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(starts), RECIPE["batch"]):
            chunk = torch.stack([windows[s:s + SEQ_LEN + 1] for s in starts[i:i + RECIPE["batch"]]]).to(device)
            logits = model(chunk[:, :-1]).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += chunk[:, 1:].numel()
    model.train()
    return {"tokens": count, "nll": total / count, "perplexity": math.exp(total / count)}


def train(out: Path, steps: int, deadline_s: float) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import DeepseekV3ForCausalLM

    RECIPE["steps"] = steps
    started = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    corpus_record = corpus.describe()
    tokenizer = train_tokenizer()
    train_ids, valid_ids = encode_split(tokenizer, "train"), encode_split(tokenizer, "valid")
    print(f"corpus: {corpus_record['splits']}; train {len(train_ids)} tokens, valid {len(valid_ids)}", flush=True)

    torch.manual_seed(SEED)
    model = DeepseekV3ForCausalLM(config()).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": RECIPE["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=RECIPE["lr"], betas=RECIPE["betas"], fused=device == "cuda")
    batches = torch.Generator().manual_seed(SEED)
    curve = []
    step = 0
    stopped_early = False
    for step in range(steps):
        if time.time() - started > deadline_s:
            stopped_early = True
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (RECIPE["batch"],), generator=batches)
        chunk = torch.stack([train_ids[s:s + SEQ_LEN + 1] for s in starts.tolist()]).to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["grad_clip"])
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "lr": learning_rate(step),
                          "seconds": round(time.time() - started, 1)})
            print(json.dumps(curve[-1]), flush=True)
    trained_steps = step + (0 if stopped_early else 1)

    model = model.to(torch.bfloat16)
    evaluation = held_out_perplexity(model, valid_ids, device, RECIPE["eval_batches"])
    print(f"held-out perplexity of the bf16 weights: {evaluation['perplexity']:.3f}", flush=True)
    model_dir = out / "model"
    save_for_sglang(model, model_dir)
    write_tokenizer(model_dir, tokenizer=tokenizer)
    record = {
        "seed": SEED, "recipe": dict(RECIPE, steps=steps), "trained_steps": trained_steps,
        "stopped_early": stopped_early, "seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE,
        "num_layers": NUM_LAYERS, "shape": SHAPE, "parameters": params, "corpus": corpus_record,
        "tokens": {"train": len(train_ids), "valid": len(valid_ids)},
        "tokens_seen": trained_steps * RECIPE["batch"] * SEQ_LEN,
        "held_out": evaluation, "curve": curve, "seconds": round(time.time() - started, 1),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    (out / "target.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=RECIPE["steps"])
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="stop training after this many seconds (recorded as stopped_early)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = train(args.out, args.steps, args.deadline_s)
    print(json.dumps({k: record[k] for k in ("trained_steps", "held_out", "parameters", "seconds")}))


if __name__ == "__main__":
    main()
