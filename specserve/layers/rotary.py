"""Rotary position embedding (rotate-half layout), with Llama 3's frequency scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from . import triton_ops


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "default":
        raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._last: tuple = (None, None, None)  # (positions, a copy of them, (cos, sin) at them): `_at`

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [n, heads, head_dim] and k [n, kv_heads, head_dim] rotated to positions [n]: in place on CUDA (one
        launch each), else side by side as one tensor (half the operations), returned as views of it."""
        if triton_ops.rotary_fits(q, q.shape[-1]):
            return self.rotate(positions, q), self.rotate(positions, k)
        qk = self.rotate(positions, torch.cat([q, k], dim=1))  # [n, heads + kv_heads, head_dim]
        return qk[:, :q.shape[1]], qk[:, q.shape[1]:]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated to positions [n] (in place on CUDA, one launch)."""
        if triton_ops.rotary_fits(x, x.shape[-1]):
            return triton_ops.rotary_(x, positions, self.cos, self.sin)
        cos, sin = self._at(positions, x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, head_dim] at positions [n] in dtype, gathered once for the layers of a forward
        (they share its positions tensor, checked against a copy: it may have changed in place since). Off a
        CPU every call gathers (the check would wait for the device)."""
        last, seen, tables = self._last
        if (positions.device.type != "cpu" or last is not positions or tables[0].dtype != dtype
                or not torch.equal(seen, positions)):
            tables = tuple(t[positions].unsqueeze(1).to(dtype) for t in (self.cos, self.sin))
            self._last = (positions, positions.clone(), tables)
        return tables


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)
