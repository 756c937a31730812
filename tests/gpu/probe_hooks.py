"""A probe attached with --forward-hooks: does flashinfer's fused all-reduce + RMSNorm run?

`count_allreduce_fusion` wraps flashinfer_allreduce_residual_rmsnorm (layernorm.py imports
it at call time, so the wrapper is what it calls) and counts the calls that returned a fused
result and those that fell back. After every forward (a hook on model.norm) each rank writes
its counts to <dir>/fusion-rank<r>.json.
"""

import json
from pathlib import Path


def count_allreduce_fusion(config):
    import torch.distributed as dist

    from sglang.srt.layers import flashinfer_comm_fusion

    counts = {"fused": 0, "fell_back": 0}
    fused_call = flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm

    def counting(*args, **kwargs):
        result = fused_call(*args, **kwargs)
        counts["fused" if result[0] is not None else "fell_back"] += 1
        return result

    flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm = counting
    out = Path(config["dir"])

    def hook(module, inputs, output):
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"fusion-rank{rank}.json").write_text(json.dumps(counts))

    return hook


def count_allreduce_fusion_spec(directory: Path) -> str:
    return json.dumps([{"name": "count_allreduce_fusion", "target_modules": ["model.norm"],
                        "hook_factory": "tests.gpu.probe_hooks:count_allreduce_fusion",
                        "config": {"dir": str(directory)}}])
