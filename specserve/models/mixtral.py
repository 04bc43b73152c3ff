"""Mixtral (Mixtral-8x7B / 8x22B layout): the Mistral decoder of llama.py with routed experts in every layer,
the top-k router weights renormalised to sum 1.

Experts (layers/moe.py) are loaded from the Hub layout, one tensor per expert:
`block_sparse_moe.experts.{e}.w1` (gate), `.w3` (up), `.w2` (down), and the router `block_sparse_moe.gate`.
"""
from __future__ import annotations

import re
from typing import Optional

from torch import nn

from ..layers.moe import GRAPH_SAFE, SparseMoeBlock
from .config import ArchConfig
from .llama import LlamaForCausalLM

EXPERT_TENSOR = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$")
ROUTER_TENSOR = re.compile(r"^(.*)\.block_sparse_moe\.gate\.weight$")


class MixtralForCausalLM(LlamaForCausalLM):
    """Mistral attention and norms from llama.py; a routed feed-forward (`mlp`) in every layer."""

    supports_cuda_graphs = GRAPH_SAFE

    def make_mlp(self, c: ArchConfig, layer: int) -> nn.Module:
        raw = c.raw
        return SparseMoeBlock(c.hidden_size, raw["num_local_experts"], raw["num_experts_per_tok"],
                              c.intermediate_size, norm_topk_prob=True)

    def checkpoint_target(self, name: str) -> Optional[tuple[str, object]]:
        """...block_sparse_moe.experts.{e}.w{1,3,2}.weight -> the stacked w13 (shard (e, 0) gate, (e, 1) up)
        or w2 (shard e) of that layer; ...block_sparse_moe.gate.weight -> its router."""
        m = EXPERT_TENSOR.match(name)
        if m is not None:
            prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
            return (f"{prefix}.mlp.experts.w2", e) if w == "2" else \
                (f"{prefix}.mlp.experts.w13", (e, 0 if w == "1" else 1))
        m = ROUTER_TENSOR.match(name)
        return (f"{m.group(1)}.mlp.gate.weight", None) if m is not None else None
