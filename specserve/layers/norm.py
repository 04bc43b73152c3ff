from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import triton_ops
from .linear import copy_checked


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face's Llama does."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.weight.weight_loader = lambda p, t, s=None: copy_checked(p, t, "norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.use_triton(x) and x.dim() == 2:
            return triton_ops.add_rms_norm(x, None, self.weight, self.eps)[0]
        return self._norm(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum is rounded to x's dtype first, as Hugging Face does."""
        if triton_ops.use_triton(x):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        stream = x if residual is None else x + residual
        return self._norm(stream), stream

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:  # one operation, the same bits
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
