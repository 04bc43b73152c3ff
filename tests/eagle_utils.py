"""Tiny random EAGLE-3 draft checkpoints in the published format, for tests."""
from __future__ import annotations

import json
import os

import torch

from specserve.models.checkpoint import save_checkpoint
from specserve.speculative.eagle3 import Eagle3Config

from .conftest import make_hf_checkpoint


def make_eagle3_checkpoint(path: str, target: str, seed: int = 0, draft_vocab: int | None = None,
                           fmt: str = "safetensors", scale: float = 0.3) -> str:
    """Write a random EAGLE-3 draft for the Hugging Face target folder `target`."""
    cfg = json.load(open(os.path.join(target, "config.json")))
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv = 4, 2
    d = h // heads
    inter = 96
    dv = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    tensors = {
        "fc.weight": r(h, 3 * h) / 3,
        "midlayer.hidden_norm.weight": 1 + r(h) * 0.1,
        "midlayer.input_layernorm.weight": 1 + r(h) * 0.1,
        "midlayer.self_attn.q_proj.weight": r(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, heads * d),
        "midlayer.post_attention_layernorm.weight": 1 + r(h) * 0.1,
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "norm.weight": 1 + r(h) * 0.1,
        "lm_head.weight": r(dv, h),
    }
    # draft vocabulary: every other target token, as offsets (target = draft + d2t[draft])
    kept = torch.arange(dv) * (vocab // dv)
    tensors["d2t"] = kept - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    tensors["t2d"] = t2d
    config = Eagle3Config(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_heads=heads, num_kv_heads=kv,
                          head_dim=d, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                          max_position_embeddings=cfg.get("max_position_embeddings", 512), target_hidden_size=h,
                          draft_vocab_size=dv, aux_layer_ids=None)
    return save_checkpoint(path, config.to_dict(), tensors, fmt=fmt)


def make_pair(root, vocab: int) -> tuple[str, str]:
    """A tiny random Llama target (4 layers, seed 3) and an EAGLE-3 draft for it (seed 1), under root."""
    target = make_hf_checkpoint(str(root / "target"), "llama", seed=3, vocab=vocab, layers=4)
    return target, make_eagle3_checkpoint(str(root / "draft"), target, seed=1)
