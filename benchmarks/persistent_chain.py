"""Whether one persistent kernel reads a chain of dependent one-row products faster than one launch per product.

Issue 22's batch-1 layer spends about as long beyond its bytes as on them. Each GEMV ramps up and drains
(~3 us on an H100 for a 17-21 MB weight), and PDL lets the next launch start but not the next weight's reads. A
persistent kernel can: its programs stay resident across the products, wait for each other at a grid barrier
(an atomic counter), and each asks L2 for its slice of the next weight before it waits. This probe times a chain
x_{l+1} = W_l @ x_l of `--layers` square bf16 weights at one row, as CUDA graphs:
- launches: `triton_gemv.gemv` once per product (the engine's decode kernel, PDL as in the engine);
- cublas: F.linear once per product;
- persistent: `_chain`, one launch, one program per multiprocessor, with and without the L2 prefetch.
Each is reported per product against the copy bandwidth's time for its bytes. The persistent chain's result is
checked against the launches' (fp32 sums in another order: within bf16 rounding).

    python benchmarks/persistent_chain.py --dims 2048 4096 --out persistent_chain.json

The kernel runs under Triton's CPU interpreter with one program (the barrier then waits for no one):
`TRITON_INTERPRET=1 python benchmarks/persistent_chain.py --check-cpu`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LINE = 64  # bf16 elements in a 128-byte line
MAX_SPINS = tl.constexpr(100_000)  # polls of the barrier's counter before a program gives up waiting (~0.1 s)


@triton.jit
def _prefetch_rows(W, rows, rmask, D, LINES: tl.constexpr):
    """Ask L2 for the lines of rows [ROWS] of W [*, D] (bf16), evict-last."""
    lines = tl.arange(0, LINES)
    ptrs = W + rows[:, None].to(tl.int64) * D + tl.minimum(lines * 64, D - 1)[None, :]
    ptrs = tl.where(rmask[:, None], ptrs, W)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chain(W, X, Counter, layers, D, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LINES: tl.constexpr,
           PREFETCH: tl.constexpr):
    # X [layers + 1, D]: row 0 the input; row l + 1 = W[l] @ row l, W [layers, D, D]. Program p computes rows
    # [p * ROWS, (p + 1) * ROWS) of every product, then waits at a grid barrier (Counter, zeroed before the
    # launch) for every program's rows of it; every program must be resident at once
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < D
    ks = tl.arange(0, BLOCK_K)
    if PREFETCH:
        _prefetch_rows(W, rows, rmask, D, LINES)
    for layer in range(layers):
        w = W + layer * D * D
        if PREFETCH:  # the next product's slice, read while this one computes and while the barrier waits
            if layer + 1 < layers:
                _prefetch_rows(w + D * D, rows, rmask, D, LINES)
        acc = tl.zeros([ROWS], tl.float32)
        for k in range(0, D, BLOCK_K):
            kmask = k + ks < D
            x = tl.load(X + layer * D + k + ks, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
            wt = tl.load(w + rows[:, None].to(tl.int64) * D + (k + ks)[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0)
            acc += tl.sum(wt.to(tl.float32) * x[None, :], 1)
        tl.store(X + (layer + 1) * D + rows, acc.to(X.dtype.element_ty), mask=rmask)
        tl.debug_barrier()  # every thread's rows stored before the program says it is done
        tl.atomic_add(Counter, 1, sem="release")
        target = (layer + 1) * programs
        spins = 0  # a bound, so that programs that are not all resident end wrong (max_diff says) rather than hang
        while (tl.atomic_add(Counter, 0, sem="acquire") < target) & (spins < MAX_SPINS):
            spins += 1
        tl.debug_barrier()


def chain(ws: torch.Tensor, x: torch.Tensor, counter: torch.Tensor, programs: int, prefetch: bool,
          out: torch.Tensor) -> torch.Tensor:
    """ws [layers, D, D], x [D] -> the chain's last row; out [layers + 1, D] scratch, counter [1] int32."""
    layers, d, _ = ws.shape
    rows = triton.next_power_of_2(triton.cdiv(d, programs))
    out[0].copy_(x)
    counter.zero_()
    _chain[(triton.cdiv(d, rows),)](ws, out, counter, layers, d, ROWS=rows, BLOCK_K=256,
                                    LINES=triton.next_power_of_2(triton.cdiv(d, LINE)), PREFETCH=prefetch,
                                    num_warps=4)
    return out[layers]


def check_cpu() -> None:
    """The kernel's products against torch's, one program (the interpreter runs programs one after another)."""
    torch.manual_seed(0)
    d, layers = 96, 3
    ws = torch.randn(layers, d, d) / d ** 0.5
    x = torch.randn(d)
    want = x
    for w in ws:
        want = w @ want
    got = chain(ws, x, torch.zeros(1, dtype=torch.int32), 1, False, torch.empty(layers + 1, d))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    print("the chain equals torch's products")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--span-mb", type=float, default=512, help="weight bytes a chain reads (several times L2)")
    ap.add_argument("--check-cpu", action="store_true")
    ap.add_argument("--out", default="persistent_chain.json")
    args = ap.parse_args()
    if args.check_cpu:
        return check_cpu()
    from attention_kernel import graph_seconds
    from gpu_decode import ceilings

    from specserve.layers import triton_gemv

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceil = ceilings("cuda")
    result = {"device": torch.cuda.get_device_name(), "ceilings": ceil, "rows": []}
    for d in args.dims:
        layers = max(2, int(args.span_mb * 1e6 // (d * d * 2)))
        ws = torch.randn(layers, d, d, dtype=torch.bfloat16, device=dev) / d ** 0.5
        x = torch.randn(d, dtype=torch.bfloat16, device=dev)
        out = torch.empty(layers + 1, d, dtype=torch.bfloat16, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)

        def launches():
            h = x.view(1, d)
            for w in ws:
                h = triton_gemv.gemv(h, w)
            return h.view(-1)

        def cublas():
            h = x
            for w in ws:
                h = torch.nn.functional.linear(h, w)
            return h

        want = launches()
        row = {"dim": d, "layers": layers, "weight_mb": d * d * 2 / 1e6,
               "copy_us": d * d * 2 / ceil["copy_bytes_per_s"] * 1e6}  # its bytes at the copy's bytes moved a second
        for name, fn in (("launches", launches), ("cublas", cublas),
                         ("persistent", lambda: chain(ws, x, counter, sms, False, out)),
                         ("persistent_prefetch", lambda: chain(ws, x, counter, sms, True, out))):
            got = fn()
            row[f"{name}_max_diff"] = (got.float() - want.float()).abs().max().item()
            row[f"{name}_us"] = graph_seconds(fn, calls=1) / layers * 1e6
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
