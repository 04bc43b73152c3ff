"""Mixture-of-experts feed-forward: a softmax top-k router and `num_experts` SwiGLU experts stored stacked.

Experts are stored stacked, [experts, ...]; each model family maps its checkpoint's per-expert tensors onto
them (`checkpoint_target`). Under tensor parallelism each expert is sharded like the dense MLP: gate/up by
output rows (column), down by input columns (row), one all-reduce of the sum. Tokens are sorted by expert
and go through one grouped GEMM for gate/up and one for down: on CUDA the Triton kernels of triton_moe.py
(SwiGLU and routing weights fused, nothing read on the host, so a CUDA graph holds them); elsewhere
`grouped_linear` (torch's grouped GEMM; a loop over the experts where torch has none for the device and dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import triton_gemv, triton_moe
from .linear import ReplicatedLinear, ShapeMismatch, copy_checked, linear
from .parallel import current
from .triton_ops import use_triton

# Can a CUDA graph hold the experts? On CUDA they run in the Triton kernels, which read nothing on the host.
GRAPH_SAFE = triton_moe.available()
# L2 policy of the router's weight loads at a few tokens (`triton_gemv.gemv`'s evict)
ROUTER_EVICTION = "evict_first"


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
        if use_triton(x):
            return self.tp.all_reduce(triton_moe.fused_experts(x, self.w13, self.w2, weights, experts))
        top_k = experts.shape[1]
        flat = experts.reshape(-1)  # [n * top_k]
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        tokens = order // top_k  # [n * top_k]: the token of each grouped assignment
        scale = weights.reshape(-1)[order].unsqueeze(1)  # [n * top_k, 1]
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))  # [experts] assignments per expert, on the device
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # [experts] each group's end
        gate, up = grouped_linear(x.index_select(0, tokens), self.w13, ends).chunk(2, dim=-1)  # [n * top_k, local]
        y = grouped_linear(F.silu(gate) * up, self.w2, ends)  # [n * top_k, hidden]
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, tokens, y * scale))


_GROUPED_FAILS: set = set()  # (device type, dtype) where torch._grouped_mm is not available


def grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert through each expert's weight: x [m, in] whose rows ends[e-1]:ends[e] belong to
    expert e, w [experts, out, in] -> [m, out]. One grouped GEMM (`torch._grouped_mm`: no host sync, so a
    CUDA graph can hold it) where torch has one for this device and dtype; else a loop over the experts
    (one host read of the group ends)."""
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_FAILS and hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(x.contiguous(), w.transpose(1, 2), offs=ends)
        except (RuntimeError, NotImplementedError):
            _GROUPED_FAILS.add(key)
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = linear(x[start:end], w[e])
        start = end
    return out


class SparseMoeBlock(nn.Module):
    """Router (softmax over experts, top-k, optionally renormalised to sum 1; on CUDA one Triton kernel,
    `triton_moe.route`) and the routed experts."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = ReplicatedLinear(hidden, num_experts)  # [experts, hidden]
        self.experts = Experts(num_experts, hidden, intermediate)

    def fuses(self, rows: int) -> bool:
        """Whether `forward_fused` takes a step of this many rows (the direct expert kernels': a few)."""
        return triton_moe.available() and rows <= triton_moe.DIRECT_TOKENS

    def forward_fused(self, scaled: torch.Tensor, rms: tuple, stream: torch.Tensor, next_norm: torch.Tensor | None,
                      launch: dict) -> tuple:
        """The feed-forward block of `DecoderLayer.forward_fused` (its contract: `llama.MLP.forward_fused`):
        the router's product with the norm fused (`triton_gemv.gemv`), `triton_moe.route`, then the experts
        with the norm, the sum, the residual add and the next norm's inputs fused (`triton_moe.direct_fused`):
        five launches where the layered path, with the norms before and after, takes seven."""
        logits = triton_gemv.gemv(scaled, self.gate.weight, launch=launch["o"], rms=rms,
                                  evict=ROUTER_EVICTION)  # [n, experts]
        weights, experts = triton_moe.route(logits, self.top_k, self.norm_topk_prob, scaled.dtype)
        return triton_moe.direct_fused(scaled, rms, self.experts.w13, self.experts.w2, weights, experts, stream,
                                       next_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        if use_triton(x):  # the router in one kernel: [n, top_k] each, experts int32
            weights, experts = triton_moe.route(self.gate(x), self.top_k, self.norm_topk_prob, x.dtype)
            return self.experts(x, weights, experts)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [n, experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [n, top_k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, weights.to(x.dtype), experts)
