"""A forward hook (attached with --forward-hooks) that fails one tensor-parallel rank only,
to check that the server exits instead of hanging when a rank raises during warmup."""

import torch.distributed as dist


def raise_on_rank(config):
    rank = int(config["rank"])

    def hook(module, inputs, output):
        if dist.is_initialized() and dist.get_rank() == rank:
            raise RuntimeError(f"injected failure on rank {rank}")

    return hook
