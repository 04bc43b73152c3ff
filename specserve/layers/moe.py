"""Mixture-of-experts feed-forward: a softmax top-k router and `num_experts` SwiGLU experts stored stacked.

Experts are stored stacked, [experts, ...]; each model family maps its checkpoint's per-expert tensors onto
them (`checkpoint_target`). Under tensor parallelism each expert is sharded like the dense MLP: gate/up by
output rows (column), down by input columns (row), one all-reduce of the sum. Tokens are routed by a plain
loop over the experts that received any (no fused kernel yet: one host read of the counts per layer, so
no CUDA graphs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ReplicatedLinear, ShapeMismatch, copy_checked
from .parallel import current


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs stacked: w13 [experts, 2 * intermediate / tp, hidden] (gate rows, then up
    rows, of this rank's shard) and w2 [experts, hidden, intermediate / tp]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.tp = current()
        self.num_experts, self.intermediate = num_experts, intermediate
        start, end = self.tp.shard_range(intermediate)
        self.local = end - start
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
        self.w13.weight_loader, self.w2.weight_loader = self.load_w13, self.load_w2
        self.w13.shard_ids = [(e, j) for e in range(num_experts) for j in (0, 1)]
        self.w2.shard_ids = list(range(num_experts))

    def _check_expert(self, e: int) -> None:
        if not 0 <= e < self.num_experts:
            raise ShapeMismatch(f"expert {e} out of range: the config has {self.num_experts} experts")

    def load_w13(self, param, loaded, shard_id: tuple[int, int]):  # loaded: [intermediate, hidden]
        e, j = shard_id
        self._check_expert(e)
        if loaded.shape[0] != self.intermediate:
            raise ShapeMismatch(f"expert {e} {('gate', 'up')[j]}_proj: expected {self.intermediate} rows, "
                                f"checkpoint has {tuple(loaded.shape)}")
        start, end = self.tp.shard_range(self.intermediate)
        copy_checked(param.data[e].narrow(0, j * self.local, self.local), loaded[start:end],
                     f"expert {e} {('gate', 'up')[j]}_proj")

    def load_w2(self, param, loaded, shard_id: int):  # loaded: [hidden, intermediate]
        self._check_expert(shard_id)
        if loaded.dim() != 2 or loaded.shape[1] != self.intermediate:
            raise ShapeMismatch(f"expert {shard_id} down_proj: expected {self.intermediate} columns, "
                                f"checkpoint has {tuple(loaded.shape)}")
        start, end = self.tp.shard_range(self.intermediate)
        copy_checked(param.data[shard_id], loaded[:, start:end], f"expert {shard_id} down_proj")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [n, hidden], weights and experts [n, top_k] -> sum over each token's experts of weight * MLP(x),
        [n, hidden], all-reduced over tensor-parallel ranks."""
        top_k = experts.shape[1]
        flat = experts.reshape(-1)  # [n * top_k]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        tokens = order // top_k  # [n * top_k]: the token of each grouped assignment
        scale = weights.reshape(-1)[order].unsqueeze(1)  # [n * top_k, 1]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        out = torch.zeros_like(x)  # [n, hidden]
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            idx = tokens[start:start + count]  # [count]
            gate, up = F.linear(x.index_select(0, idx), self.w13[e]).chunk(2, dim=-1)  # [count, local] each
            y = F.linear(F.silu(gate) * up, self.w2[e])  # [count, hidden]
            out.index_add_(0, idx, y * scale[start:start + count])
            start += count
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router (softmax over experts, top-k, optionally renormalised to sum 1) and the routed experts."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = ReplicatedLinear(hidden, num_experts)  # [experts, hidden]
        self.experts = Experts(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, top_k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, weights.to(x.dtype), experts)
