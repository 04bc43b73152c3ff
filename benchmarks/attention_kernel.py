"""The paged-attention kernel alone on a GPU: KV bytes read per second at each (batch, context, query tokens per
sequence) for each number of key splits, and for launch settings given on the command line, beside the split
count the engine would choose.

    python benchmarks/attention_kernel.py --out attention.json
    python benchmarks/attention_kernel.py --cells 1x16384x1 1x32768x1 --splits 16 32 64 128 \\
        --launch 64,4,3 128,4,3 128,8,2 --out attention.json       # BLOCK_N,num_warps,num_stages

Shapes are one layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head size 128, bf16, pages of 16
tokens placed at random in the pool). Times are medians of CUDA-event timings of a CUDA graph of 16 attention
calls (the split kernel and the merge), per call.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gpu_decode import ceilings, time_events  # noqa: E402

from specserve.layers import triton_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def captured(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn, run once outside the capture first (compiling its kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_seconds(fn, calls: int = 16) -> float:
    """Seconds per call of fn, replayed from a CUDA graph of `calls` calls (launch overhead excluded, as in the
    engine's graphs)."""
    return time_events(captured(fn, calls).replay, 10) / calls


def cell(batch: int, context: int, q: int, splits: list, launches: list, bandwidth: float) -> dict:
    dev = torch.device("cuda")
    blocks = -(-(context + q) // PAGE)
    pool = batch * blocks + 1
    cache = torch.randn(1, 2, pool * PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    perm = torch.randperm(pool - 1, generator=torch.Generator().manual_seed(0)).view(-1)[:batch * blocks]
    tables = perm.view(batch, blocks).tolist()
    qs = torch.randn(batch * q, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    k = torch.randn(batch * q, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    kv_bytes = batch * (context + q) * KV_HEADS * HEAD_DIM * 2 * 2
    build = triton_attention.build_triton_metadata
    chosen = build([q] * batch, [context + q] * batch, tables, PAGE, dev, HEADS // KV_HEADS, kv_cache=cache).num_splits
    out = {"batch": batch, "context": context, "q": q, "kv_bytes": kv_bytes, "chosen_splits": chosen, "runs": []}
    default = triton_attention.launch_options
    try:
        for launch in launches:
            if launch is not None:
                block_n, warps, stages = launch
                triton_attention.launch_options = lambda *_: {"BLOCK_N": block_n, "num_warps": warps,
                                                              "num_stages": stages,
                                                              "PAGES_AHEAD": triton_attention.PAGES_AHEAD}
            for s in splits:
                meta = build([q] * batch, [context + q] * batch, tables, PAGE, dev, HEADS // KV_HEADS,
                             kv_cache=cache, num_splits=s)
                seconds = graph_seconds(lambda: meta.attend(qs, k, v, cache[0], HEAD_DIM ** -0.5, kv_written=True))
                run = {"splits": s, "launch": launch, "us": seconds * 1e6, "gb_per_s": kv_bytes / seconds / 1e9,
                       "of_copy": kv_bytes / seconds / bandwidth}
                out["runs"].append(run)
                print(f"batch {batch:>3} context {context:>6} q {q}: splits {s:>3} launch {launch}: "
                      f"{run['us']:8.1f} us {run['gb_per_s']:7.0f} GB/s = {run['of_copy']:.0%} of copy"
                      f"{'  (chosen)' if s == chosen and launch is None else ''}", flush=True)
    finally:
        triton_attention.launch_options = default
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", default=["1x4096x1", "1x16384x1", "1x32768x1", "16x4096x1",
                                                   "16x16384x1", "64x4096x1", "256x256x1", "1x16384x4"],
                    help="batch x context x query tokens per sequence")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--launch", nargs="*", default=[],
                    help="BLOCK_N,num_warps,num_stages settings to try besides the engine's")
    ap.add_argument("--out", default="attention_kernel.json")
    args = ap.parse_args()
    ceil = ceilings("cuda")
    launches = [None] + [tuple(int(x) for x in s.split(",")) for s in args.launch]
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "cells": []}
    for spec in args.cells:
        b, c, q = (int(x) for x in spec.split("x"))
        result["cells"].append(cell(b, c, q, args.splits, launches, ceil["copy_bytes_per_s"]))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
