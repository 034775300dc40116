"""``SyncBatchNorm``: batch normalization with the statistics of every rank's batch together."""
from __future__ import annotations

import torch

from mtrain.ringreduce import Sum

from .mpi_ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over the batch of every rank together (drop-in for
    ``torch.nn.SyncBatchNorm`` / Horovod's ``hvd.SyncBatchNorm``).

    In training each rank's per-channel sum, sum of squares and count are summed
    over ranks by one all-reduce; the gradient flows back through that (differentiable)
    all-reduce, so every rank's input gradient is that of the whole batch. In eval
    mode (with running statistics) it is a plain local batch norm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                                  self.bias, False, 0.0, self.eps)
        channels = input.shape[1]
        work = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        dims = [d for d in range(work.dim()) if d != 1]
        # The statistics in float64: E[x²] - E[x]² in float32 loses the variance of data whose
        # mean is large next to its spread (torch's own kernels use Welford's method instead).
        wide = work.double()
        local_count = torch.full((1,), work.numel() // channels, dtype=torch.float64, device=work.device)
        stats = torch.cat([wide.sum(dims), (wide * wide).sum(dims), local_count])
        total = allreduce(stats, op=Sum, name=None)
        count = total[-1]
        mean64 = total[:channels] / count
        var64 = (total[channels:2 * channels] / count - mean64 * mean64).clamp_min(0)  # rounding can go below 0
        mean, var = mean64.to(work.dtype), var64.to(work.dtype)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1)) if float(count) > 1 else var
                self.running_mean.mul_(1 - momentum).add_(mean.detach().to(self.running_mean.dtype) * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach().to(self.running_var.dtype) * momentum)
        shape = [1, channels] + [1] * (work.dim() - 2)
        out = (work - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out.to(input.dtype)
