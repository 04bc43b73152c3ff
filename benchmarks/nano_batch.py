"""Whether a batch-256 decode step gains from running its two halves on two streams, each half's attention
(bound by memory) beside the other half's products (bound by compute), as NanoFlow's nano-batches do.

Issue 23's batch-256 step at 256 keys is ~7 ms of cuBLAS products under the power cap and ~2.8 ms of attention,
one after the other. This probe times `--layers` decoder layers of the Llama-3.1-8B shape (q/k/v, paged attention
over `--context` keys, o, gate/up, SwiGLU, down; norms and residuals left out) as CUDA graphs, four ways:
- full: the batch on one stream;
- halves: its two halves one after the other on one stream (what splitting costs the products);
- overlap: the halves on two streams, each free to run ahead;
- alternate: the halves on two streams, their attentions taking turns (B's attention of layer l after A's, A's
  of layer l + 1 after B's of l), so that each attention runs beside the other half's products.
Each graph is timed after a second of replays (the clocks a decode runs at under the power cap); attention and the
products are also timed alone at the full batch.

    python benchmarks/nano_batch.py --batch 256 --context 288 --out nano_batch.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from attention_kernel import captured  # noqa: E402
from gpu_decode import ceilings, time_events  # noqa: E402

from specserve.layers import triton_attention  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, PAGE = 4096, 32, 8, 128, 14336, 16


class Layers:
    """`layers` sets of 8B-shaped weights and a KV cache each (so that nothing stays in L2 between layers)."""

    def __init__(self, layers: int, batch: int, context: int, dev: torch.device):
        def w(*shape):
            return torch.randn(*shape, dtype=torch.bfloat16, device=dev) * 0.02

        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = [w(qkv, HIDDEN) for _ in range(layers)]
        self.o = [w(HIDDEN, HIDDEN) for _ in range(layers)]
        self.gate_up = [w(2 * FFN, HIDDEN) for _ in range(layers)]
        self.down = [w(HIDDEN, FFN) for _ in range(layers)]
        blocks = -(-(context + 1) // PAGE)
        pool = batch * blocks + 1
        self.cache = torch.randn(layers, 2, pool * PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        perm = torch.randperm(pool - 1, generator=torch.Generator().manual_seed(0))[:batch * blocks]
        self.tables = perm.view(batch, blocks).tolist()
        self.context = context

    def meta(self, rows: slice) -> triton_attention.TritonMetadata:
        tables = self.tables[rows]
        return triton_attention.build_triton_metadata([1] * len(tables), [self.context + 1] * len(tables), tables,
                                                      PAGE, self.cache.device, HEADS // KV_HEADS, kv_cache=self.cache)

    def attention(self, x: torch.Tensor, layer: int, meta) -> torch.Tensor:
        # x [M, hidden] -> attention output [M, hidden] (q, k, v from the q/k/v product; the keys already cached)
        m = x.shape[0]
        qkv = F.linear(x, self.qkv[layer])  # [M, (H + 2 Hkv) D]
        q = qkv[:, :HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(m, KV_HEADS, HEAD_DIM)
        return meta.attend(q, k, k, self.cache[layer], HEAD_DIM ** -0.5, kv_written=True).view(m, HIDDEN)

    def mlp(self, a: torch.Tensor, layer: int) -> torch.Tensor:
        gu = F.linear(F.linear(a, self.o[layer]), self.gate_up[layer])  # [M, 2 ffn]
        return F.linear(F.silu(gu[:, :FFN]) * gu[:, FFN:], self.down[layer])  # [M, hidden]


def sustained_seconds(graph: torch.cuda.CUDAGraph, warm_s: float = 1.0) -> float:
    """Seconds a replay, timed after warm_s of replays."""
    end = time.perf_counter() + warm_s
    while time.perf_counter() < end:
        graph.replay()
        torch.cuda.synchronize()
    return time_events(graph.replay, 20)


def schedules(net: Layers, x: torch.Tensor, layers: int) -> dict:
    """Each way of running the step, as a function to capture."""
    half = x.shape[0] // 2
    full, a_meta, b_meta = net.meta(slice(None)), net.meta(slice(0, half)), net.meta(slice(half, None))
    xa, xb = x[:half].clone(), x[half:].clone()
    side = torch.cuda.Stream()

    def one(h, meta, layer):
        return net.mlp(net.attention(h, layer, meta), layer)

    def run_full():
        h = x
        for layer in range(layers):
            h = one(h, full, layer)

    def run_halves():
        ha, hb = xa, xb
        for layer in range(layers):
            ha = one(ha, a_meta, layer)
            hb = one(hb, b_meta, layer)

    def run_streams(alternate: bool):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        ha, hb = xa, xb
        b_done = None
        for layer in range(layers):
            if alternate and b_done is not None:
                main.wait_event(b_done)
            att_a = net.attention(ha, layer, a_meta)
            a_done = torch.cuda.Event()
            a_done.record(main)
            ha = net.mlp(att_a, layer)
            with torch.cuda.stream(side):
                if alternate:
                    side.wait_event(a_done)
                att_b = net.attention(hb, layer, b_meta)
                b_done = torch.cuda.Event()
                b_done.record(side)
                hb = net.mlp(att_b, layer)
        main.wait_stream(side)

    def attention_only():
        for layer in range(layers):
            net.attention(x, layer, full)

    def products_only():
        for layer in range(layers):
            net.mlp(F.linear(x, net.qkv[layer])[:, :HIDDEN], layer)

    return {"full": run_full, "halves": run_halves, "overlap": lambda: run_streams(False),
            "alternate": lambda: run_streams(True), "attention_only": attention_only,
            "products_only": products_only}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--context", type=int, default=288)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="nano_batch.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceilings(dev), "context": args.context,
              "layers": args.layers, "cells": []}
    for batch in args.batch:
        net = Layers(args.layers, batch, args.context, dev)
        x = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device=dev)
        graphs = {name: captured(fn) for name, fn in schedules(net, x, args.layers).items()}
        cell = {"batch": batch, "rounds": []}
        for _ in range(args.rounds):
            times = {name: sustained_seconds(g) / args.layers * 1e6 for name, g in graphs.items()}
            cell["rounds"].append(times)
            print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()) + " a layer",
                  flush=True)
        result["cells"].append(cell)
        del graphs, net
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
