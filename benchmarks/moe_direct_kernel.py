"""The few-token MoE kernels alone on a GPU (`triton_moe._direct`: gate/up with SiLU, then down scaled by the
routing weight): expert weight bytes read per second at 1 and 2 tokens of the Qwen3-30B-A3B shape, for each
launch setting given, beside the default.

    python benchmarks/moe_direct_kernel.py --up 0,128,4 16,256,4 16,512,8 --down 0,128,4 32,256,4 --out moe.json

A setting is BLOCK_N,BLOCK_K,num_warps (BLOCK_N 0: the default rule, `triton_gemv.block_n`). Each kernel is timed
on its own (the other at the default), as a CUDA graph cycling through copies of the expert weights (so none
is read from L2), with distinct experts per token. bf16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from attention_kernel import graph_seconds  # noqa: E402
from gpu_decode import ceilings  # noqa: E402

from specserve.layers import triton_moe  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SPAN = 8 * 2**30  # bytes of expert weights a graph cycles through


def parse(text: str) -> tuple[int, int, int]:
    n, k, w = (int(v) for v in text.split(","))
    return n, k, w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--up", nargs="+", default=["0,128,4"], help="gate/up launches: BLOCK_N,BLOCK_K,num_warps")
    ap.add_argument("--down", nargs="+", default=["0,128,4"], help="down launches")
    ap.add_argument("--out", default="moe_direct_kernel.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = ceilings("cuda")
    layer_bytes = EXPERTS * 3 * INTER * HIDDEN * 2
    copies = max(1, SPAN // layer_bytes)
    w13s = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    w2s = [torch.randn(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "runs": []}
    for n in args.tokens:
        x = torch.randn(n, HIDDEN, dtype=torch.bfloat16, device=dev)
        experts = torch.randperm(EXPERTS, device=dev)[:n * TOP_K].view(n, TOP_K)
        weights = torch.full((n, TOP_K), 1.0 / TOP_K, device=dev)

        def seconds(up, down) -> float:
            return graph_seconds(lambda: [triton_moe._direct(x, w13, w2, weights, experts, up, down)
                                          for w13, w2 in zip(w13s, w2s)], calls=1) / copies
        base = seconds(triton_moe.DIRECT_UP, triton_moe.DIRECT_DOWN)
        want = triton_moe._direct(x, w13s[0], w2s[0], weights, experts)
        print(f"tokens {n}: default up+down {base * 1e6:.1f} us", flush=True)
        for kernel, launches in (("up", args.up), ("down", args.down)):
            nbytes = n * TOP_K * (2 if kernel == "up" else 1) * INTER * HIDDEN * 2
            for text in launches:
                launch = parse(text)
                up, down = (launch, triton_moe.DIRECT_DOWN) if kernel == "up" else (triton_moe.DIRECT_UP, launch)
                got = triton_moe._direct(x, w13s[0], w2s[0], weights, experts, up, down)
                error = (got.float() - want.float()).abs().max().item()
                both = seconds(up, down)
                result["runs"].append({"tokens": n, "kernel": kernel, "launch": launch, "both_us": both * 1e6,
                                       "default_both_us": base * 1e6, "kernel_bytes": nbytes, "max_error": error})
                print(f"tokens {n} {kernel:>4} {text:>10}: up+down {both * 1e6:7.1f} us ({(both - base) * 1e6:+6.1f}"
                      f" vs default), {kernel} {nbytes / 1e6:.1f} MB, max |diff| {error:.2e}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
