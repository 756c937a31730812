"""SpecForge's command line on the CPU, for the smoke test: its EAGLE-3 loss is a Triton kernel,
which needs a GPU driver, so the same value in PyTorch takes its place (`-sum(target_p *
log_softmax(logits))` over the positions the mask keeps, averaged over the rows); the rest is
SpecForge's own trainer. Run as `python -m tests.acceptance.specforge_cpu train -c RUN.json`."""

import sys

import torch


class TorchLogSoftmaxLoss:
    @staticmethod
    def apply(logits, target_p, position_mask):
        return -(position_mask * target_p * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


if __name__ == "__main__":
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.cli import main

    eagle3_model.LogSoftmaxLoss = TorchLogSoftmaxLoss
    sys.exit(main(sys.argv[1:]))
