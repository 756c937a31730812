"""The anchor's features: SpecForge 0.2.0's own in-process capture with SGLang 0.5.14 (its
`specforge.offline_capture` package) over the same records the dump holds.

SpecForge drives that package with scripts/prepare_hidden_states.py of its repository, which its
wheel does not install; this module makes the same library calls with nothing of ours in
between: SpecForge's process group (`init_distributed`), its resolution of the layers to capture
from the draft config (`resolve_offline_capture`, through SGLang's
`set_eagle3_layers_to_capture`), its SGLang model runner and logits processor wrapper
(`load_offline_capture`), its `capture`, and its layout's `materialize` for each record. Records
are captured one at a time (SpecForge pads a batch to its longest record and keeps the padding's
rows; one at a time nothing is padded), and written with export_specforge's file naming.

Run as its own process (SGLang's model runner and SpecForge's process group live for the
process), on a GPU (SpecForge's runner binds `torch.cuda.current_device()`):

    python -m scripts.acceptance.specforge_capture --target MODEL --draft-config CONFIG \
        --records RECORDS.jsonl --out DIR [--max-tokens 1024] [--attention-backend triton]

It prints one JSON line: samples, tokens, the layers SpecForge resolved and SGLang captures.
"""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_group_env() -> None:
    """What torchrun would set for one process: SpecForge's init_distributed reads it."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(name, value)


def capture(target: Path, draft_config: Path, records: Path, out: Path, max_tokens: int, server_kwargs: dict,
            device: str = "cuda") -> dict:
    import torch
    from specforge.application import resolve_offline_capture
    from specforge.config import Config
    from specforge.distributed import init_distributed
    from specforge.offline_capture import load_offline_capture
    from transformers import AutoConfig, AutoTokenizer

    from scripts.dumps.export_specforge import sample_path, save

    started = time.monotonic()
    single_process_group_env()
    init_distributed(tp_size=1)
    target_config = AutoConfig.from_pretrained(str(target))
    plan = resolve_offline_capture(
        Config(model={"target_model_path": str(target), "draft_model_config": str(draft_config)},
               data={"hidden_states_path": str(out), "max_length": max_tokens},
               training={"strategy": "eagle3"}),
        target_config=target_config)
    layers = list(plan.capture_layers)
    model = load_offline_capture(str(target), torch_dtype=torch.bfloat16, max_running_requests=1,
                                 max_total_tokens=max_tokens, **server_kwargs)
    model.set_capture_layers(layers, capture_method=plan.capture_method)
    sglang_model = model._backend.model_runner.model
    captured_layers = sorted(getattr(sglang_model, "layers_to_capture", None)
                             or getattr(sglang_model.model, "layers_to_capture", []))
    loaded_s = time.monotonic() - started
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    samples = tokens = 0
    with open(records, encoding="utf-8") as lines:
        for idx, line in enumerate(lines):
            # generate's plain text encoding (chat.ChatEncoder.encode_text), cut as SpecForge reads it
            ids = tokenizer(json.loads(line)["text"])["input_ids"][:max_tokens]
            input_ids = torch.tensor([ids], device=device)
            ones = torch.ones_like(input_ids)
            batch = model.capture(input_ids=input_ids, attention_mask=ones, loss_mask=ones)
            record = plan.layout.materialize({
                "input_ids": batch.input_ids[0].cpu(),
                "loss_mask": batch.loss_mask[0].cpu(),
                "aux_hidden_states": batch.hidden_states[0].cpu().unsqueeze(0),
                "last_hidden_states": batch.last_hidden_states[0].cpu().unsqueeze(0),
            })
            path = sample_path(out, idx)
            path.parent.mkdir(parents=True, exist_ok=True)
            save(record, path, compress=False)
            samples += 1
            tokens += len(ids)
    return {"samples": samples, "tokens": tokens, "resolved_layers": layers, "sglang_layers_to_capture": captured_layers,
            "features": {name: str(value.dtype) + str(list(value.shape)) for name, value in record.items()},
            "load_s": round(loaded_s, 1), "capture_s": round(time.monotonic() - started - loaded_s, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft-config", type=Path, required=True)
    parser.add_argument("--records", type=Path, required=True, help="JSON Lines of {\"id\", \"text\"}")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--attention-backend", default=None, help="SGLang's attention backend (its default: unset)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.3)
    args = parser.parse_args(argv)
    server_kwargs = {"mem_fraction_static": args.mem_fraction_static}
    if args.attention_backend:
        server_kwargs["attention_backend"] = args.attention_backend
    result = capture(args.target, args.draft_config, args.records, args.out, args.max_tokens, server_kwargs)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
