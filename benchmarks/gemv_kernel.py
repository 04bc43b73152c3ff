"""The few-row linear alone on a GPU: weight bytes read per second by F.linear (cuBLAS), by the same product
in other orientations and BLAS libraries (`--blas`), and by the Triton kernel of
`specserve/layers/triton_gemv.py` (its default launch and the ones given), per weight shape of the
Llama-3.1-8B and Qwen3-30B-A3B shapes, at 1, 2 and 4 rows.

    python benchmarks/gemv_kernel.py --out gemv.json
    python benchmarks/gemv_kernel.py --rows 1 --launch 32,256,4,4,dot 16,512,4,3,fma --out gemv.json
    python benchmarks/gemv_kernel.py --rows 1 4 --sweep --out gemv.json   # the launch grid of `sweep_launches`
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


def cell(name: str, rows: int, launches: list, blas: list, bandwidth: float) -> dict:
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
        if launch is not None and not launch[4] and rows > 4:
            continue  # the FMA accumulator grows with the rows
        label = "gemv" if launch is None else "gemv " + ",".join(str(v) for v in launch[:4]) + \
            (",dot" if launch[4] else ",fma")
        run(label, lambda w, launch=launch: triton_gemv.gemv(x, w, launch=launch))
    return out


def layer_chain(launch, pdl: bool, layers: int = 32) -> float:
    """Seconds per layer of a graph of `layers` 8B-shaped layers' four products at one row (q/k/v, o, gate/up,
    down, each reading the one before's output and its own weights): launch None = F.linear, else the Triton
    kernel at that launch, each launched to overlap the one before when pdl."""
    dev = torch.device("cuda")
    names = ("8b.qkv", "8b.o", "8b.gate_up", "8b.down")
    weights = [[torch.randn(*SHAPES[n], dtype=torch.bfloat16, device=dev) for n in names] for _ in range(layers)]
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)

    def forward():
        h = x
        for ws in weights:
            for w in ws:
                h = h[:, :w.shape[1]]  # [1, K]: the leading features of the product before
                h = F.linear(h, w) if launch is None else triton_gemv.gemv(h, w, launch=launch, pdl=pdl)
        return h

    seconds = graph_seconds(forward, calls=1) / layers
    weights.clear()
    torch.cuda.empty_cache()
    return seconds


def parse_launch(text: str) -> tuple:
    """'BLOCK_N,BLOCK_K,warps,stages,dot|fma' -> triton_gemv.Launch."""
    *numbers, kind = text.split(",")
    if len(numbers) != 4 or kind not in ("dot", "fma"):
        raise argparse.ArgumentTypeError(f"a launch is BLOCK_N,BLOCK_K,warps,stages,dot|fma, got {text!r}")
    return (*(int(v) for v in numbers), kind == "dot")


def sweep_launches() -> list:
    """Tensor-core tiles of 16-64 weight rows by 128-512 columns, 4-8 warps, 3-6 stages; FMA tiles beside."""
    dot = [(n, k, w, s, True) for n in (16, 32, 64) for k in (128, 256, 512) for w, s in ((4, 3), (4, 5), (8, 4))]
    fma = [(n, k, w, s, False) for n in (4, 8, 16) for k in (256, 512) for w, s in ((4, 3), (4, 5))]
    return dot + fma


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--launch", nargs="*", type=parse_launch, default=[],
                    help="BLOCK_N,BLOCK_K,warps,stages,dot|fma launches to try besides the default")
    ap.add_argument("--sweep", action="store_true", help="try every launch of `sweep_launches` too")
    ap.add_argument("--blas", nargs="*", default=[], choices=("wx", "lt", "xwt"),
                    help="other cuBLAS orientations / libraries beside F.linear")
    ap.add_argument("--chain", nargs="*", type=parse_launch, default=None,
                    help="also time 32 layers' chained products at one row: F.linear, and each launch given here "
                    "(none: the default) with and without programmatic dependent launch")
    ap.add_argument("--no-triton", action="store_true", help="leave the Triton kernel out")
    ap.add_argument("--out", default="gemv_kernel.json")
    args = ap.parse_args()
    ceil = ceilings("cuda")
    launches = [] if args.no_triton else [None] + args.launch + (sweep_launches() if args.sweep else [])
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "cells": []}
    if args.chain is not None:
        chain = result["chain_us_per_layer"] = {"F.linear": layer_chain(None, False) * 1e6}
        for launch in args.chain or [None]:
            for pdl in (False, True):
                label = f"gemv {launch or 'default'}{' pdl' if pdl else ''}"
                chosen = launch or triton_gemv.default_launch(4096, 4096, torch.device("cuda"))
                chain[label] = layer_chain(chosen, pdl) * 1e6
        print("chain, us per layer: " + "; ".join(f"{k} {v:.1f}" for k, v in chain.items()), flush=True)
    for rows in args.rows:
        for name in args.shapes:
            result["cells"].append(cell(name, rows, launches, args.blas, ceil["copy_bytes_per_s"]))
            best = min((r for r in result["cells"][-1]["runs"] if r["kernel"].startswith("gemv")),
                       key=lambda r: r["us"], default=None)
            if best is not None:
                print(f"{name:>16} rows {rows}: best {best['kernel']} {best['us']:.1f} us = {best['of_copy']:.0%}"
                      " of copy", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
