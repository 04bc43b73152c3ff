from __future__ import annotations

import torch
from torch import nn

from .linear import copy_checked


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Hugging Face's Llama does."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.weight.weight_loader = lambda p, t, s=None: copy_checked(p, t, "norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
