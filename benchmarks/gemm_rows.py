"""The 8B shape's decoder products at a batch's rows, under sustained load: cuBLAS as F.linear calls it, cuBLASLt
preferred (`torch.backends.cuda.preferred_blas_library`), and a plain Triton tl.dot kernel at several tiles. The
question for issue 23's batch 256 (its step is ~7 ms of cuBLAS products at 450-620 TFLOP/s, at the GPU's power
cap): does any tile or library run these shapes faster, before a product with fused epilogues is worth writing?

    python benchmarks/gemm_rows.py --rows 256 --out gemm_rows.json

Each product is a CUDA graph of one call per layer, each on its own weight copy (nothing read from L2), replayed
for `--warm` seconds before timing (the clocks a sustained decode runs at), then the median of 10 replays.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from attention_kernel import captured  # benchmarks/ is on sys.path when run as a script
from gpu_decode import time_events

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
TILES = [(128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8),
         (64, 64, 64, 5, 4), (128, 128, 128, 3, 8), (64, 256, 64, 4, 8)]  # BM, BN, BK, stages, warps

if triton is not None:
    @triton.jit
    def _mm(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr):
        # Y [M, N] = X [M, K] @ W [N, K].T, program tiles grouped GROUP column tiles at a time
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BM)
        width = GROUP * grid_m
        first_n = pid // width * GROUP
        size = tl.minimum(tl.cdiv(N, BN) - first_n, GROUP)
        pid_n = first_n + (pid % width) % size
        pid_m = (pid % width) // size
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]  # [BM, BK]
        w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BK, BN]
        acc = tl.zeros((BM, BN), tl.float32)
        for _ in tl.range(0, K, BK, num_stages=STAGES):
            acc = tl.dot(tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0),
                         tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0), acc)
            x_ptrs += BK
            w_ptrs += BK
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_mm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tile: tuple) -> None:
    bm, bn, bk, stages, warps = tile
    m, (n, k) = x.shape[0], w.shape
    assert k % bk == 0, f"K ({k}) must be a multiple of BK ({bk})"
    _mm[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=bm,
                                                    BN=bn, BK=bk, STAGES=stages, GROUP=8, num_warps=warps)


def sustained_seconds(fn, warm: float) -> float:
    """Seconds per replay of a CUDA graph of fn, after `warm` seconds of replays (the median of 10)."""
    graph = captured(fn)
    end = time.perf_counter() + warm
    while time.perf_counter() < end:
        graph.replay()
        torch.cuda.synchronize()
    return time_events(graph.replay, 10, warmup=0)


def operands(k: int, n: int, rows: int, layers: int) -> tuple:
    """Rows x [rows, k], `layers` weight copies [n, k] and outputs [rows, n] (bf16 on CUDA), F.linear of the first
    weight in fp32, and the product's FLOPs."""
    dev = torch.device("cuda")
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(layers)]
    ys = [torch.empty(rows, n, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    return x, ws, ys, F.linear(x, ws[0]).float(), 2 * rows * n * k


def shape_rows(name: str, k: int, n: int, rows: int, layers: int, warm: float) -> list[dict]:
    x, ws, ys, want, flops = operands(k, n, rows, layers)
    out = []

    def record(impl: str, seconds: float, **extra) -> None:
        us = seconds / layers * 1e6
        out.append({"shape": name, "impl": impl, "us": us, "tflops": flops / us / 1e6, **extra})
        print(f"{name:>8} {impl:>9} {extra.get('tile', '')!s:>26} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s",
              flush=True)

    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        record(library, sustained_seconds(lambda: [F.linear(x, w) for w in ws], warm))
    torch.backends.cuda.preferred_blas_library("cublas")
    for tile in TILES if triton is not None else ():
        triton_mm(x, ws[0], ys[0], tile)
        error = (ys[0].float() - want).abs().max().item()
        record("triton", sustained_seconds(lambda: [triton_mm(x, w, y, tile) for w, y in zip(ws, ys)], warm),
               tile=list(tile), max_error=error)
    return out


def product_arguments(doc: str, out: str, warm: float) -> argparse.ArgumentParser:
    """The options a benchmark of these products takes (rows, shapes, weight copies, warm-up, output)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--layers", type=int, default=32, help="weight copies a graph cycles through")
    ap.add_argument("--warm", type=float, default=warm, help="seconds of replays before timing")
    ap.add_argument("--out", default=out)
    return ap


def main() -> None:
    args = product_arguments(__doc__, "gemm_rows.json", 1.0).parse_args()
    results = []
    for rows in args.rows:
        for name in args.shapes:
            results += [dict(r, rows=rows) for r in shape_rows(name, *SHAPES[name], rows, args.layers, args.warm)]
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": getattr(triton, "__version__", None), "args": vars(args), "results": results}, f,
                  indent=1)


if __name__ == "__main__":
    main()
