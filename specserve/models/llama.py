"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3): one implementation, configured by
`ArchConfig` (q/k/v bias, q/k norm, tied embeddings, rope scaling)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import linear, lora, triton_gemv, triton_ops
from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.norm import RMSNorm
from ..layers.parallel import current
from ..layers.rotary import RotaryEmbedding
from .config import ArchConfig, DecoderShape

FUSED_ROWS = triton_gemv.MAX_DOT_ROWS  # steps of up to this many tokens run `LlamaModel.fused_rows`'s path


class DecoderAttention(nn.Module):
    """A decoder layer's self-attention: q/k/v projection, optional q/k norm, rotary, paged attention, output
    projection. input_size: the projected features (default the hidden size; EAGLE-3's draft layer projects
    [embedding, hidden] pairs of twice that)."""

    def __init__(self, c: DecoderShape, rotary: RotaryEmbedding, input_size: Optional[int] = None,
                 qkv_bias: bool = False, qk_norm: bool = False, layer: int = 0):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(input_size or c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads,
                                          bias=qkv_bias)
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.heads, self.kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = c.head_dim
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.heads, self.kv_heads, c.head_dim, layer)

    def _split(self, qkv: torch.Tensor, norm: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k and v [n, kv_heads, head_dim] of the projection qkv [n, q + k + v] (q/k
        normed, unless norm is False: `rope_and_cache` norms them)."""
        n = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None and norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention output [n, heads * head_dim] of the projection qkv [n, q + k + v]: q/k norm, rotary,
        the cache write and paged attention (the first three in one launch, `triton_ops.rope_and_cache`, where
        the metadata `fuses_kv_write`)."""
        n = qkv.shape[0]
        if meta.fuses_kv_write and triton_ops.rotary_fits(qkv, self.head_dim):
            q, k, v = self._split(qkv, norm=False)
            qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            triton_ops.rope_and_cache(q, k, v, positions, self.rotary.cos, self.rotary.sin, self.attn.cache(meta),
                                      meta.slot_mapping, qk_norm)
            out = self.attn(q, k, v, meta, kv_written=True)
        else:
            q, k, v = self._split(qkv)
            q, k = self.rotary(positions, q, k)
            out = self.attn(q, k, v, meta)  # [n, heads, head_dim]
        return out.reshape(n, -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), positions, meta))

    def attend_fused(self, scaled: torch.Tensor, rms: tuple, positions: torch.Tensor, meta: AttentionMetadata,
                     launch: triton_gemv.Launch) -> torch.Tensor:
        """The attention output [n, heads * head_dim] of a stream whose input norm `triton_gemv` applies (scaled
        [n, hidden], the stream times the norm's weight, and rms, its parts and eps): q/k/v as one GEMV whose
        epilogue also rotates q and k and writes the cache where it can (no q/k norm, metadata that
        `fuses_kv_write`), then `attend`'s work."""
        qkv = self.qkv_proj
        if not (self.q_norm is None and meta.fuses_kv_write and triton_gemv.pairs_fit(self.head_dim, launch)):
            return self.attend(triton_gemv.gemv(scaled, qkv.weight, qkv.bias, launch, rms=rms), positions, meta)
        rope = triton_gemv.RopeWrite(self.rotary.cos, self.rotary.sin, positions, self.attn.cache(meta),
                                     meta.slot_mapping, self.heads, self.kv_heads, self.head_dim)
        q, k, v = self._split(triton_gemv.gemv(scaled, qkv.weight, qkv.bias, launch, rms=rms, rope=rope))
        return self.attn(q, k, v, meta, kv_written=True).reshape(scaled.shape[0], -1)

    def store_kv(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Write the keys and values of x [n, input_size] at positions [n] into cache slots [n] of this layer
        in kv_cache ([layers, 2, slots, kv_heads, head_dim]), attending to nothing: what forward would store."""
        cache = kv_cache[self.attn.layer]
        n = x.shape[0]
        k, v = (t.view(n, self.kv_heads, self.head_dim) for t in self.qkv_proj.kv(x))
        if triton_ops.rotary_fits(x, self.head_dim):  # one launch: k's norm, rotary and both cache writes
            qk_norm = None if self.k_norm is None else (self.k_norm.weight, self.k_norm.weight, self.k_norm.eps)
            triton_ops.rope_and_cache(k[:, :0], k, v, positions, self.rotary.cos, self.rotary.sin, cache, slots,
                                      qk_norm)
            return
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = self.rotary.rotate(positions, k)
        cache[0, slots] = k
        cache[1, slots] = v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [n, 2 * intermediate]
        if triton_ops.use_triton(gate_up):
            return self.down_proj(triton_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def fuses(self, rows: int) -> bool:
        """Whether `forward_fused` takes a step of this many rows: up to FUSED_ROWS, gate/up pairs fitting."""
        return rows <= FUSED_ROWS and triton_gemv.pairs_fit(self.gate_up_proj.weight.shape[0],
                                                            triton_gemv.layer_launches(rows)["gate_up"])

    def forward_fused(self, scaled: torch.Tensor, rms: tuple, stream: torch.Tensor, next_norm: torch.Tensor | None,
                      launch: dict) -> tuple:
        """A feed-forward block of `DecoderLayer.forward_fused`: scaled [n, hidden] (the stream times the
        post-attention norm's weight) and rms (the stream's parts, eps) in, the stream after the block, its
        parts and it times next_norm out, as `triton_gemv.gemv`'s residual epilogue: two products here."""
        act = triton_gemv.gemv(scaled, self.gate_up_proj.weight, launch=launch["gate_up"], rms=rms, gate=True)
        return triton_gemv.gemv(act, self.down_proj.weight, launch=launch["down"], residual=stream, scale=next_norm)


class DecoderLayer(nn.Module):
    def __init__(self, c: ArchConfig, rotary: RotaryEmbedding, mlp: nn.Module, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DecoderAttention(c, rotary, qkv_bias=c.qkv_bias, qk_norm=c.qk_norm, layer=layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp  # [n, hidden] -> [n, hidden]

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous sublayer's output, residual: the stream before it (None at the first layer).
        Returns this layer's MLP output and the stream before it; their sum is the layer's output."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(x), residual

    def forward_fused(self, stream: torch.Tensor, parts: torch.Tensor, scaled: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, next_norm: torch.Tensor | None) -> tuple:
        """`forward` for a step of a few tokens in its products and attention (`fused_rows`): the stream
        [n, hidden] entering the layer, parts (its sums of squares in pieces) and scaled (it times the input
        norm's weight) -> the same leaving it, scaled by next_norm (the next layer's input norm weight; None:
        not scaled)."""
        attn, post = self.self_attn, self.post_attention_layernorm
        launch = triton_gemv.layer_launches(stream.shape[0])
        out = attn.attend_fused(scaled, (parts, self.input_layernorm.eps), positions, meta, launch["qkv"])
        stream, parts, scaled = triton_gemv.gemv(out, attn.o_proj.weight, launch=launch["o"], residual=stream,
                                                 scale=post.weight)
        return self.mlp.forward_fused(scaled, (parts, post.eps), stream, next_norm, launch)


class LlamaModel(nn.Module):
    def __init__(self, c: ArchConfig, make_mlp: Callable[[ArchConfig, int], nn.Module]):
        """make_mlp(config, layer index) builds each layer's feed-forward block: forward, and `fuses` and
        `forward_fused` for the few-row path (as `MLP`)."""
        super().__init__()
        rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, rotary, make_mlp(c, i), i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.tp = current()

    def fused_rows(self, h: torch.Tensor) -> bool:
        """Whether a step of h [num_tokens, hidden] runs `forward_fused`: 1 to FUSED_ROWS tokens on CUDA in
        half precision, on one rank, where every layer's feed-forward block `fuses` them (a dense MLP up to
        FUSED_ROWS, routed experts up to `triton_moe.DIRECT_TOKENS`). A decode step at batch 1, or its verify, is
        its weights' reads; the path fuses each layer's norms, rotary, cache write, activation and residual adds
        into the products (`triton_gemv`): five launches a dense layer where there were nine to eleven, nine a
        layer of experts where there were eleven. Not while LoRA adapters apply (their deltas are `forward`'s)."""
        n = h.shape[0]
        return (0 < n <= FUSED_ROWS and linear.GEMV_ROWS >= 1 and triton_ops.use_triton(h) and not lora.active()
                and h.dtype in (torch.bfloat16, torch.float16) and self.norm.weight.dtype == h.dtype
                and self.tp.size == 1 and all(layer.mlp.fuses(n) for layer in self.layers))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids, positions [num_tokens] -> final hidden [num_tokens, hidden] (normed) and the residual
        stream entering each layer in aux_layers (what EAGLE-3 drafters read; num_layers = the last output)."""
        h, residual = self.embed_tokens(ids), None  # [num_tokens, hidden]; the stream is h + residual
        if self.fused_rows(h):
            return self._forward_fused(h, positions, meta, aux_layers)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                seen[i] = h if residual is None else h + residual
            h, residual = layer(h, residual, positions, meta)
        out, seen[len(self.layers)] = self.norm.add_norm(h, residual)
        return out, [seen[i] for i in aux_layers]

    def _forward_fused(self, stream: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward` for a few tokens: stream [n, hidden] the embedding, then each layer's output stream."""
        seen = {}
        parts = stream.float().pow(2).sum(1, keepdim=True)  # [n, 1]
        scaled = stream * self.layers[0].input_layernorm.weight  # [n, hidden]
        for i, layer in enumerate(self.layers):
            seen[i] = stream
            after = self.layers[i + 1].input_layernorm.weight if i + 1 < len(self.layers) else None
            stream, parts, scaled = layer.forward_fused(stream, parts, scaled, positions, meta, after)
        seen[len(self.layers)] = stream
        return self.norm(stream), [seen[i] for i in aux_layers]


class LlamaForCausalLM(nn.Module):
    """The dense families (see registry.MODELS); implements interface.CausalLM. A family that differs only in
    its feed-forward blocks subclasses this and overrides make_mlp."""

    supports_cuda_graphs = True
    # checkpoint name part -> (our parameter name part, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, c: ArchConfig):
        super().__init__()
        self.config = c
        self.model = LlamaModel(c, self.make_mlp)
        self.lm_head = ParallelLMHead(c.vocab_size, c.hidden_size)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, c: ArchConfig, layer: int) -> nn.Module:
        return MLP(c.hidden_size, c.intermediate_size)

    def forward(self, ids, positions, meta, aux_layers: tuple[int, ...] = ()):
        return self.model(ids, positions, meta, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def embedding(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens

    def checkpoint_target(self, name: str) -> None:
        return None  # packed_modules maps every tensor
