"""Linear layers written for tensor parallelism; plain `x @ W.T (+ b)` at world size 1.

A layer is a shard of the `TensorParallel` state current when it is built (see `parallel.building`).
Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies a full checkpoint
tensor's slice for this rank into it, checking shapes; the model loader calls it by parameter name.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import cublaslt, triton_gemv
from .lora import LoRAStack, add_lora
from .parallel import current


class ShapeMismatch(ValueError):
    pass


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ShapeMismatch(f"{what}: expected shape {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _attach(param: nn.Parameter | None, loader) -> None:
    if param is not None:
        param.weight_loader = loader


FEW_ROWS = 128  # fp32 products of up to this many rows on a CPU are computed as weight @ rows.T (`linear`)
GEMV_ROWS = 1  # half-precision products of this many rows on CUDA run as `triton_gemv` (faster than cuBLAS at one)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight.T [in, out] (+ bias): F.linear, except for int8 weights (`int8_linear`, scale
    [out] their per-row scales), one half-precision row on CUDA
    (`triton_gemv`, faster than cuBLAS there), many half-precision rows on CUDA whose shape has a tuned
    cuBLASLt algorithm (`cublaslt.product`), and fp32 products of up to FEW_ROWS rows on a CPU, computed as
    (weight @ rows.T).T from row-major rows (one row doubled to two) into a row-major result.
    MKL's kernels for a small right-hand side stream the weight 2-3x faster than its matrix-vector product
    and than F.linear's at a few rows, but only from row-major rows: the same product from a transposed
    view ran 2-3x slower, so every result here is row-major for the product after it (2-core AMD EPYC, AVX2,
    torch 2.13, the shipped target's weights: gate/up at one row 255 us as F.linear, 119 us so; at four rows
    from row-major rows 123 us, from a transposed view 372 us; docs/performance.md, session 28). Above
    FEW_ROWS (prefill) F.linear is faster again (350 rows: 3.6 against 7.8 ms)."""
    if weight.dtype == torch.int8:
        return int8_linear(x, weight, scale, bias)
    if x.requires_grad or weight.requires_grad:
        return F.linear(x, weight, bias)
    if x.is_cuda:
        if _gemv_fits(x, weight):
            return triton_gemv.gemv(x, weight, bias)
        y = cublaslt.product(x, weight)
        return F.linear(x, weight, bias) if y is None else _shaped(y, bias, x)
    if x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # [m, in]
    m = rows.shape[0]
    if not 0 < m <= FEW_ROWS:
        return F.linear(x, weight, bias)
    rows = rows.expand(2, -1).contiguous() if m == 1 else rows.contiguous()  # [max(m, 2), in] row-major
    return _shaped(_rows_of(weight @ rows.T, m), bias, x)


def _shaped(y: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The product rows y [m, out] of x [..., in] with the bias added, shaped [..., out]."""
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _rows_of(y: torch.Tensor, m: int) -> torch.Tensor:
    """The first m columns of y [out, >= m] as row-major rows [m, out]. numpy's transposing copy: torch's
    took 4-6x as long at these shapes on the 2-core CPU (4 x 1,728: 26 against 6 us; 2 x 4,096: 25 against 4)."""
    return torch.from_numpy(np.ascontiguousarray(y.numpy().T[:m]))


INT8_IN_MULTIPLE = 16  # torch's int8 kernel reads rows 16 values at a time, aligned, with no tail (AVX-512)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """x [..., in] @ (weight * scale[:, None]).T (+ bias), weight [out, in] int8 and scale [out] bfloat16
    (`LinearBase.quantize_int8`; in a multiple of INT8_IN_MULTIPLE): torch's weight-only int8 kernel, which
    takes bfloat16 rows on 32-byte boundaries; the result in x's dtype. On the 2-core CPU it streams a
    drafter's products 2-3x faster than MKL's fp32 ones (the drafter's LM head at one row: 121 against 283
    us, cache cold), reading a quarter of the bytes."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # [m, in]
    if rows.data_ptr() % 32:
        rows = rows.clone()
    return _shaped(torch.ops.aten._weight_int8pack_mm(rows, weight, scale).to(x.dtype), bias, x)


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `triton_gemv` computes x @ weight.T: half precision, 1 to GEMV_ROWS rows, K contiguous."""
    return (triton_gemv.triton is not None and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(1) == 1
            and 0 < x.numel() // x.shape[-1] <= GEMV_ROWS)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.tp = current()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.register_buffer("weight_scale", None, persistent=False)  # [out] once quantize_int8 ran
        self.lora: Optional[LoRAStack] = None  # room for LoRA adapters, once reserved (layers/lora.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_lora(self.lora, x, linear(x, self.weight, self.bias, self.weight_scale))

    parts = 1  # the projections fused in the weight (each may carry its own LoRA matrices)

    def reserve_lora(self, slots: int, rank: int) -> None:
        """Room for `slots` adapters of rank up to `rank` on each fused part."""
        out, inp = self.weight.shape
        self.lora = LoRAStack(slots, rank * self.parts, inp, out, self.weight.dtype, self.weight.device)

    def quantize_int8(self) -> None:
        """Keep the weight as int8 rows, each with one bfloat16 scale (symmetric, its largest magnitude to
        127): products then run as `int8_linear`. For drafters on a CPU, where their output only proposes."""
        if self.weight.shape[1] % INT8_IN_MULTIPLE:
            raise ValueError(f"int8 weights need input features in multiples of {INT8_IN_MULTIPLE}; this layer "
                             f"has {self.weight.shape[1]}")
        w = self.weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.weight = nn.Parameter(q.contiguous(), requires_grad=False)
        self.weight_scale = scale.to(torch.bfloat16)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        _attach(self.weight, self.load)
        _attach(self.bias, self.load)

    def load(self, param, loaded, shard_id=None):
        copy_checked(param, loaded, "replicated linear")


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_out = out_features
        start, end = current().shard_range(out_features)
        super().__init__(in_features, end - start, bias)
        _attach(self.weight, self.load)
        _attach(self.bias, self.load)

    def load(self, param, loaded, shard_id=None):
        start, end = self.tp.shard_range(loaded.shape[0])
        copy_checked(param, loaded[start:end], "column-parallel linear")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        self.parts = len(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias)

    def load(self, param, loaded, shard_id: int):
        if loaded.shape[0] != self.out_sizes[shard_id]:
            raise ShapeMismatch(f"merged linear part {shard_id}: expected {self.out_sizes[shard_id]} rows, "
                                f"checkpoint has {tuple(loaded.shape)}")
        world = self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // world
        size = self.out_sizes[shard_id] // world
        start, end = self.tp.shard_range(self.out_sizes[shard_id])
        copy_checked(param.data.narrow(0, offset, size), loaded[start:end], f"merged linear part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix. Query heads split across ranks; KV heads split too, or
    replicated when there are fewer KV heads than ranks."""

    parts = 3

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        world = current().size
        if num_heads % world:
            raise ValueError(f"{num_heads} attention heads do not divide over {world} ranks")
        if num_kv_heads % world and world % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads neither divide nor replicate over {world} ranks")
        self.head_dim = head_dim
        self.full_rows = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        self.num_heads = num_heads // world
        self.num_kv_heads = max(1, num_kv_heads // world)
        self.kv_replicas = max(1, world // num_kv_heads)
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden, local_out, bias)
        _attach(self.weight, self.load)
        _attach(self.bias, self.load)

    def load(self, param, loaded, shard_id: str):
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.tp.rank // self.kv_replicas) * kv_size
        if loaded.shape[0] != self.full_rows[shard_id]:
            raise ShapeMismatch(f"{shard_id}_proj: expected {self.full_rows[shard_id]} rows, checkpoint has "
                                f"{tuple(loaded.shape)}")
        copy_checked(param.data.narrow(0, offset, size), loaded[start:start + size], f"{shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v of x [n, in] alone ([n, kv_heads * head_dim] each): the rows of the weight after q's, a
        third of the work of a full projection where there are four query heads per KV head."""
        q_size = self.num_heads * self.head_dim
        bias = None if self.bias is None else self.bias[q_size:]
        scale = None if self.weight_scale is None else self.weight_scale[q_size:]
        return linear(x, self.weight[q_size:], bias, scale).chunk(2, dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        start, end = current().shard_range(in_features)
        super().__init__(end - start, out_features, bias)
        _attach(self.weight, self.load)
        _attach(self.bias, self.load_bias)

    def load(self, param, loaded, shard_id=None):
        start, end = self.tp.shard_range(loaded.shape[1]) if loaded.dim() == 2 else (0, 0)
        copy_checked(param, loaded[:, start:end] if loaded.dim() == 2 else loaded, "row-parallel linear")

    def load_bias(self, param, loaded, shard_id=None):
        copy_checked(param, loaded, "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = add_lora(self.lora, x, linear(x, self.weight, scale=self.weight_scale))  # partial sums, deltas too
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
