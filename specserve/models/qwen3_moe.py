"""Qwen3-MoE (Qwen3-30B-A3B / 235B-A22B layout): the Qwen3 decoder of llama.py with routed experts in place
of the dense MLP, except in the layers config.json keeps dense (`mlp_only_layers`, `decoder_sparse_step`).

Experts (layers/moe.py) are loaded from the Hub layout, one tensor per expert:
`mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""
from __future__ import annotations

import re
from typing import Optional

from torch import nn

from ..layers.moe import GRAPH_SAFE, SparseMoeBlock
from .config import ArchConfig
from .llama import MLP, LlamaForCausalLM

EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def num_experts(raw: dict) -> int:
    """The Hub's config.json says `num_experts`; transformers 5 saves it as `num_local_experts`."""
    return raw.get("num_experts") or raw.get("num_local_experts") or 0


def is_sparse(c: ArchConfig, layer: int) -> bool:
    """Whether decoder layer `layer` has routed experts (transformers' rule) rather than a dense MLP."""
    raw = c.raw
    return (layer not in (raw.get("mlp_only_layers") or []) and num_experts(raw) > 0
            and (layer + 1) % raw.get("decoder_sparse_step", 1) == 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3 attention (q/k RMSNorm) and norms from llama.py; feed-forward per `is_sparse`."""

    supports_cuda_graphs = GRAPH_SAFE

    def make_mlp(self, c: ArchConfig, layer: int) -> nn.Module:
        if not is_sparse(c, layer):
            return MLP(c.hidden_size, c.intermediate_size)
        raw = c.raw
        return SparseMoeBlock(c.hidden_size, num_experts(raw), raw["num_experts_per_tok"],
                              raw["moe_intermediate_size"], raw.get("norm_topk_prob", False))

    def checkpoint_target(self, name: str) -> Optional[tuple[str, object]]:
        """model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight -> the stacked w13 (shard (e, 0 or 1))
        or w2 (shard e) of that layer."""
        m = EXPERT_TENSOR.match(name)
        if m is None:
            return None
        prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
        return (f"{prefix}.w2", e) if part == "down" else (f"{prefix}.w13", (e, 0 if part == "gate" else 1))
