"""The few-row linear alone on a GPU: weight bytes read per second by F.linear (cuBLAS), by the same product
in other orientations and BLAS libraries (`--blas`), and by the Triton kernel of
`specserve/layers/triton_gemv.py` (its default launch and the ones given), per weight shape of the
Llama-3.1-8B and Qwen3-30B-A3B shapes, at 1, 2 and 4 rows.

    python benchmarks/gemv_kernel.py --out gemv.json
    python benchmarks/gemv_kernel.py --rows 1 --launch 8,512,4,3 16,256,4,5 --out gemv.json
    python benchmarks/gemv_kernel.py --rows 1 4 --sweep --out gemv.json   # the launch grid of `sweep_launches`
    python benchmarks/gemv_kernel.py --shapes 8b.qkv 8b.down --rows 4 --launch 32,128,4,5,1 --fused
    python benchmarks/gemv_kernel.py --rows 1 4 16 --blas wx lt xwt --no-triton --out blas.json

`--blas`: `wx` = (W @ x.T).T, `lt` = F.linear with cuBLASLt preferred, `xwt` = x @ W.T stored contiguous
([in, out]).

Times are medians of CUDA-event timings of a CUDA graph that cycles through copies of the weight (at least
256 MiB of them, so none is read from the 50 MiB L2), per call. bf16 throughout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from attention_kernel import graph_seconds  # noqa: E402
from gpu_decode import ceilings  # noqa: E402

from specserve.layers import triton_gemv  # noqa: E402

try:
    from triton.runtime.errors import OutOfResources
except ImportError:
    OutOfResources = RuntimeError

SHAPES = {  # name: (out features N, in features K)
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "8b.lm_head": (128256, 4096),
    "30b-a3b.qkv": (5120, 2048), "30b-a3b.o": (2048, 4096), "30b-a3b.router": (128, 2048),
    "30b-a3b.lm_head": (151936, 2048),
}
SPAN = 256 * 2**20  # bytes of weight copies a graph cycles through


def _with_lt(fn):
    def call(w):
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return fn(w)
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return call


def cell(name: str, rows: int, launches: list, blas: list, bandwidth: float, fused: bool = False) -> dict:
    n, k = SHAPES[name]
    dev = torch.device("cuda")
    nbytes = n * k * 2
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(max(1, -(-SPAN // nbytes)))]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
    out = {"shape": name, "n": n, "k": k, "rows": rows, "weight_bytes": nbytes, "runs": []}

    def run(label, fn) -> None:
        try:
            seconds = graph_seconds(lambda: [fn(w) for w in weights], calls=1) / len(weights)
        except OutOfResources as e:
            print(f"{name:>16} rows {rows}: {label:>16} does not fit: {e}", flush=True)
            return
        entry = {"kernel": label, "us": seconds * 1e6, "gb_per_s": nbytes / seconds / 1e9,
                 "of_copy": nbytes / seconds / bandwidth}
        out["runs"].append(entry)
        print(f"{name:>16} rows {rows}: {label:>16} {entry['us']:8.1f} us {entry['gb_per_s']:7.0f} GB/s "
              f"= {entry['of_copy']:.0%} of copy", flush=True)

    run("F.linear", lambda w: F.linear(x, w))
    if "wx" in blas:
        run("(W @ x.T).T", lambda w: (w @ x.T).T)
    if "lt" in blas:
        run("F.linear lt", _with_lt(lambda w: F.linear(x, w)))
    if "xwt" in blas:
        transposed = {id(w): w.T.contiguous() for w in weights}  # [k, n] each
        run("x @ Wt", lambda w: x @ transposed[id(w)])
        del transposed
    for launch in launches:
        launch = triton_gemv.Launch(*(launch or triton_gemv.one_row_launch(n, dev)))
        if rows > (triton_gemv.MAX_DOT_ROWS if launch.dot else triton_gemv.MAX_ROWS):
            continue
        label = "gemv " + ",".join(str(int(v)) for v in launch)
        run(label, lambda w, launch=launch: triton_gemv.gemv(x, w, launch=launch))
        for what, product in (fused_products(name, rows, launch) if fused else {}).items():
            run(f"{label} {what}", product)
    return out


def fused_products(name: str, rows: int, launch) -> dict:
    """What the fused decoder path runs around an 8B product (`LlamaModel.fused_rows`): name -> product of a
    weight."""
    dev, (n, k) = torch.device("cuda"), SHAPES[name]
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
    rms = (torch.rand(rows, 128, device=dev), 1e-6)
    residual = torch.randn(rows, n, dtype=torch.bfloat16, device=dev)
    scale = torch.randn(n, dtype=torch.bfloat16, device=dev)
    out = {"rms": lambda w: triton_gemv.gemv(x, w, launch=launch, rms=rms),
           "residual+scale": lambda w: triton_gemv.gemv(x, w, launch=launch, residual=residual, scale=scale)}
    if name == "8b.gate_up":
        out["rms+gate"] = lambda w: triton_gemv.gemv(x, w, launch=launch, rms=rms, gate=True)
    if name == "8b.qkv" and triton_gemv.pairs_fit(128, launch):
        table = torch.randn(4096, 128, device=dev)
        rope = triton_gemv.RopeWrite(table, table, torch.arange(rows, device=dev) + 100,
                                     torch.empty(2, 64, 8, 128, dtype=torch.bfloat16, device=dev),
                                     torch.arange(rows, device=dev), 32, 8, 128)
        out["rms+rope"] = lambda w: triton_gemv.gemv(x, w, launch=launch, rms=rms, rope=rope)
    return out


def parse_launch(text: str) -> tuple:
    """'BLOCK_N,BLOCK_K,warps,stages[,dot]' -> triton_gemv.Launch (dot 1: tensor cores)."""
    numbers = text.split(",")
    if len(numbers) not in (4, 5) or not all(v.isdigit() for v in numbers):
        raise argparse.ArgumentTypeError(f"a launch is BLOCK_N,BLOCK_K,warps,stages[,dot], got {text!r}")
    return triton_gemv.Launch(*(int(v) for v in numbers[:4]), *(bool(int(v)) for v in numbers[4:]))


def sweep_launches() -> list:
    """Strips of 2-16 weight rows by 512 or 2048 columns, 4 warps, 2, 3 or 5 stages."""
    return [(n, k, 4, s) for n in (2, 4, 8, 16) for k in (512, 2048) for s in (2, 3, 5)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--launch", nargs="*", type=parse_launch, default=[],
                    help="BLOCK_N,BLOCK_K,warps,stages[,dot] launches to try besides triton_gemv.one_row_launch")
    ap.add_argument("--fused", action="store_true",
                    help="also time each launch with what the fused decoder path runs around an 8B product")
    ap.add_argument("--sweep", action="store_true", help="try every launch of `sweep_launches` too")
    ap.add_argument("--blas", nargs="*", default=[], choices=("wx", "lt", "xwt"),
                    help="other cuBLAS orientations / libraries beside F.linear")
    ap.add_argument("--no-triton", action="store_true", help="leave the Triton kernel out")
    ap.add_argument("--out", default="gemv_kernel.json")
    args = ap.parse_args()
    ceil = ceilings("cuda")
    launches = [] if args.no_triton else [None] + args.launch + (sweep_launches() if args.sweep else [])
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "cells": []}
    for rows in args.rows:
        for name in args.shapes:
            result["cells"].append(cell(name, rows, launches, args.blas, ceil["copy_bytes_per_s"], args.fused))
            best = min((r for r in result["cells"][-1]["runs"] if r["kernel"].startswith("gemv")),
                       key=lambda r: r["us"], default=None)
            if best is not None:
                print(f"{name:>16} rows {rows}: best {best['kernel']} {best['us']:.1f} us = {best['of_copy']:.0%}"
                      " of copy", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
