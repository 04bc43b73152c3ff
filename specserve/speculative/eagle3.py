"""The EAGLE-3 draft head: one Llama decoder layer that reads the target's hidden states.

Checkpoint format (as published EAGLE-3 drafters ship it): config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, optional `target_hidden_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc.weight [H, 3*Ht]`, `midlayer.*` (q/k/v take
2H inputs: the token embedding and the hidden state side by side), `norm.weight`, `lm_head.weight
[draft_vocab, H]`, `d2t` (draft id -> target id offsets) and `t2d` (training only). No embedding: the
target's is shared.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..layers import triton_ops
from ..layers.attention import Attention, AttentionMetadata
from ..layers.linear import INT8_IN_MULTIPLE, LinearBase, ReplicatedLinear
from ..layers.norm import RMSNorm
from ..layers.parallel import WHOLE
from ..layers.rotary import RotaryEmbedding
from ..models.config import ArchConfig, DecoderShape, read_config
from ..models.llama import MLP, DecoderAttention, LlamaForCausalLM
from ..models.loader import WeightError, build, dummy_weights, load_weights

DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config(DecoderShape):
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: Optional[tuple[int, ...]]  # "output of layer i" as the checkpoint states them

    @classmethod
    def from_dict(cls, cfg: dict) -> "Eagle3Config":
        archs = cfg.get("architectures") or []
        if not any(a in DRAFT_ARCHITECTURES for a in archs):
            raise ValueError(f"unknown draft architecture {archs!r}; EAGLE-3 drafts declare "
                             f"{DRAFT_ARCHITECTURES[0]}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"an EAGLE-3 draft has one decoder layer, config says {cfg['num_hidden_layers']}")
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            **DecoderShape.fields_from(cfg),
            target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            aux_layer_ids=tuple(aux) if aux else None,
        )

    def to_dict(self, torch_dtype: Optional[str] = None) -> dict:
        """The draft's config.json (`from_dict` reads it back); eagle_config only when the layer ids are set."""
        cfg = {"architectures": [DRAFT_ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1,
               **self.hf_fields(), "draft_vocab_size": self.draft_vocab_size,
               "target_hidden_size": self.target_hidden_size}
        if torch_dtype is not None:
            cfg["torch_dtype"] = torch_dtype
        if self.aux_layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return cfg

    def target_aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """Layers whose *input* residual stream the draft reads (low, mid, high)."""
        if self.aux_layer_ids is not None:
            return tuple(i + 1 for i in self.aux_layer_ids)
        return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DecoderAttention(c, rotary, input_size=2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, embed: nn.Module, ids, hidden, positions, meta):
        h = self.self_attn(self._inputs(embed, ids, hidden), positions, meta) + hidden
        return h + self.mlp(self.post_attention_layernorm(h))

    def store_kv(self, embed: nn.Module, ids, hidden, positions, slots, kv_cache) -> None:
        """Only the KV cache writes of forward (slots [n] of kv_cache): no attention, no output."""
        self.self_attn.store_kv(self._inputs(embed, ids, hidden), positions, slots, kv_cache)

    def _inputs(self, embed: nn.Module, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[n, 2H]: the normed token embeddings of ids [n] beside the normed hidden [n, H]."""
        if triton_ops.use_triton(hidden) and hidden.dim() == 2 and getattr(embed, "tp", WHOLE).size == 1:
            return triton_ops.embed_norm_pair(ids, embed.weight, hidden, self.input_layernorm.weight,
                                              self.hidden_norm.weight, self.hidden_norm.eps)
        return torch.cat([self.input_layernorm(embed(ids)), self.hidden_norm(hidden)], dim=-1)


class Eagle3Draft(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, c: Eagle3Config, embed_tokens: nn.Module):
        """embed_tokens: the target's token embedding (whole), which the draft shares; kept out of the draft's
        parameters (the target owns and loads it)."""
        super().__init__()
        self.__dict__["embed_tokens"] = embed_tokens  # not a submodule
        self.config = c
        self.fc = ReplicatedLinear(3 * c.target_hidden_size, c.hidden_size)
        self.midlayer = Eagle3MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = ReplicatedLinear(c.hidden_size, c.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logit_rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [n]; hidden [n, 3*Ht] target features (first step) or [n, H] the draft's own
        previous output. Returns (logits over the draft vocabulary [n, draft_vocab], or only for
        logit_rows when given, and the pre-norm hidden [n, H])."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        h = self.midlayer(self.embed_tokens, ids, hidden, positions, meta)
        out = h if logit_rows is None else h[logit_rows]
        return self.lm_head(self.norm(out)), h

    def store_kv(self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """The draft KV of pairs (ids [n], target features [n, 3*Ht]) at positions [n], written into cache
        slots [n] without attending: a pair's KV depends on nothing else, so pairs whose outputs nobody
        reads (all but the last of a catch-up) need only this. kv_cache: [1, 2, slots, kv_heads, head_dim]."""
        self.midlayer.store_kv(self.embed_tokens, ids, self.fc(features), positions, slots, kv_cache)

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def quantize_int8(self) -> None:
        """Every product of the draft from int8 weights (`LinearBase.quantize_int8`) where its input features
        allow (multiples of INT8_IN_MULTIPLE: every published drafter's); the shared embedding stays the
        target's."""
        for module in self.modules():
            if isinstance(module, LinearBase) and module.weight.shape[1] % INT8_IN_MULTIPLE == 0:
                module.quantize_int8()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _draft_tensors(folder: str):
    from ..models.loader import iterate_tensors

    bin_path = os.path.join(folder, "pytorch_model.bin")
    if any(f.endswith(".safetensors") for f in os.listdir(folder)):
        tensors = iterate_tensors(folder)
    elif os.path.isfile(bin_path):
        tensors = torch.load(bin_path, map_location="cpu", weights_only=True).items()
    else:
        raise WeightError(f"{folder!r} has neither *.safetensors nor pytorch_model.bin")
    for name, t in tensors:
        name = name[len("model."):] if name.startswith("model.") else name
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        yield name, t


def load_eagle3(folder: str, target: ArchConfig, embed_tokens: nn.Module, dtype: torch.dtype, device: torch.device,
                load_format: str = "safetensors", seed: int = 0) -> Eagle3Draft:
    """Load a draft that shares the target's embed_tokens and check that it fits the target (hidden size,
    vocabulary, layer ids); with load_format "dummy", random weights of the config's shape (d2t zero: the
    first draft_vocab_size ids)."""
    c = Eagle3Config.from_dict(read_config(folder))
    if c.target_hidden_size != target.hidden_size:
        raise ValueError(f"draft expects target hidden size {c.target_hidden_size}, target has {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary {c.vocab_size} does not match the target's {target.vocab_size}")
    if c.hidden_size != target.hidden_size:
        raise ValueError(f"draft hidden size {c.hidden_size} differs from the target's {target.hidden_size}; "
                         f"the shared embedding needs them equal")
    bad = [i for i in c.target_aux_layers(target.num_layers) if not 0 <= i <= target.num_layers]
    if bad:
        raise ValueError(f"draft reads target layer {bad[0]}, the target has {target.num_layers} layers")
    model = build(Eagle3Draft, c, dtype, device, embed_tokens)
    if load_format == "dummy":
        dummy_weights(model, seed + 1)
        return model.eval()
    tensors = {}
    for name, t in _draft_tensors(folder):
        if name == "t2d":
            continue
        if name == "d2t":
            if tuple(t.shape) != (c.draft_vocab_size,):
                raise WeightError(f"tensor d2t: expected shape ({c.draft_vocab_size},), got {tuple(t.shape)}")
            model.d2t.copy_(t.long())
            ids = torch.arange(c.draft_vocab_size, device=model.d2t.device) + model.d2t
            if ids.min() < 0 or ids.max() >= c.vocab_size:
                raise WeightError("tensor d2t maps draft ids outside the target vocabulary")
            continue
        tensors[name] = t
    load_weights(model, iter(tensors.items()), Eagle3Draft.packed_modules)
    return model.eval()
