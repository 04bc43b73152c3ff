"""Whether one persistent kernel reads a chain of dependent one-row products faster than one launch per product.

Issue 22's batch-1 layer spends about as long beyond its bytes as on them. Each GEMV ramps up and drains
(~3 us on an H100 for a 17-21 MB weight), and PDL lets the next launch start but not the next weight's reads. A
persistent kernel can: its programs stay resident across the products, wait for each other at a grid barrier
(an atomic counter), and each asks L2 for its slice of the next weight before it waits. This probe times a chain
x_{l+1} = W_l @ x_l of square bf16 weights (`--span-mb` of them) at one row, as CUDA graphs:
- launches: `triton_gemv.gemv` once per product (the engine's decode kernel, PDL as in the engine);
- cublas: F.linear once per product;
- persistent: `_chain`, one launch, a few programs per multiprocessor, with and without the L2 prefetch, or
  `_chain_ahead`, whose programs load their weights one chunk ahead, across the barrier too (`--persistent`).
Each is reported per product against the copy bandwidth's time for its bytes. Session 52's answer (H100): a grid
barrier costs ~1.4 us with the next weights in flight against ~1.7-2.3 us a launch beyond its bytes; the
look-ahead wins 14% at 8 MB and loses at 33 MB. The persistent chain's result is
checked against the launches' (fp32 sums in another order: within bf16 rounding).

    python benchmarks/persistent_chain.py --dims 512 2048 4096 --out persistent_chain.json

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
def _counter(Counter, POLL: tl.constexpr):
    """The barrier's count: an atomic read (POLL 0) or an acquire load by every thread (POLL 1)."""
    if POLL == 0:
        return tl.atomic_add(Counter, 0, sem="acquire")
    else:
        ptrs = Counter + tl.zeros([1], tl.int32)
        seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                         is_pure=False, pack=1)
        return tl.max(seen, 0)


@triton.jit
def _chain(W, X, Counter, layers, D, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, LINES: tl.constexpr,
           PREFETCH: tl.constexpr, POLL: tl.constexpr):
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
        while (_counter(Counter, POLL) < target) & (spins < MAX_SPINS):
            spins += 1
        tl.debug_barrier()


@triton.jit
def _chain_ahead(W, X, Counter, layers, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    # as _chain, but each program's weights are loaded one chunk ahead, across the barrier too: the next product's
    # first chunk is in flight while the program waits for the others
    NK: tl.constexpr = D // BLOCK_K
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < D
    ks = tl.arange(0, BLOCK_K)
    wrow = W + rows[:, None].to(tl.int64) * D + ks[None, :]  # [ROWS, BLOCK_K] pointers into W[0]
    total = layers * NK
    wt = tl.load(wrow, mask=rmask[:, None], other=0.0)
    acc = tl.zeros([ROWS], tl.float32)
    for i in range(total):
        layer = i // NK
        c = i % NK
        if (c == 0) & (layer > 0):
            spins = 0
            while (_counter(Counter, 0) < layer * programs) & (spins < MAX_SPINS):
                spins += 1
            tl.debug_barrier()
        x = tl.load(X + layer * D + c * BLOCK_K + ks, cache_modifier=".cg").to(tl.float32)
        j = i + 1
        more = ks[None, :] * 0 + j < total  # [1, BLOCK_K]: a next chunk exists
        nxt = tl.load(wrow + (j // NK).to(tl.int64) * D * D + (j % NK) * BLOCK_K, mask=rmask[:, None] & more,
                      other=0.0)
        acc += tl.sum(wt.to(tl.float32) * x[None, :], 1)
        wt = nxt
        if c == NK - 1:
            tl.store(X + (layer + 1) * D + rows, acc.to(X.dtype.element_ty), mask=rmask)
            acc = tl.zeros([ROWS], tl.float32)
            tl.debug_barrier()
            tl.atomic_add(Counter, 1, sem="release")


def chain(ws: torch.Tensor, x: torch.Tensor, counter: torch.Tensor, programs: int, prefetch: bool,
          out: torch.Tensor, block_k: int = 256, warps: int = 4, poll: int = 0) -> torch.Tensor:
    """ws [layers, D, D], x [D] -> the chain's last row; out [layers + 1, D] scratch, counter [1] int32.
    block_k 0: a program's whole slice in one load; poll 2: _chain_ahead (block_k must divide D)."""
    layers, d, _ = ws.shape
    rows = triton.next_power_of_2(triton.cdiv(d, programs))
    out[0].copy_(x)
    counter.zero_()
    if poll == 2:
        _chain_ahead[(triton.cdiv(d, rows),)](ws, out, counter, layers, d, ROWS=rows, BLOCK_K=min(block_k or d, d),
                                              num_warps=warps)
        return out[layers]
    _chain[(triton.cdiv(d, rows),)](ws, out, counter, layers, d, ROWS=rows,
                                    BLOCK_K=block_k or triton.next_power_of_2(d),
                                    LINES=triton.next_power_of_2(triton.cdiv(d, LINE)), PREFETCH=prefetch,
                                    POLL=poll, num_warps=warps)
    return out[layers]


def check_cpu() -> None:
    """The kernel's products against torch's, one program (the interpreter runs programs one after another)."""
    torch.manual_seed(0)
    d, layers = 128, 3
    ws = torch.randn(layers, d, d) / d ** 0.5
    x = torch.randn(d)
    want = x
    for w in ws:
        want = w @ want
    for poll, block_k in ((0, 256), (2, 32), (2, 0)):
        got = chain(ws, x, torch.zeros(1, dtype=torch.int32), 1, False, torch.empty(layers + 1, d), block_k, 4, poll)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    print("the chain equals torch's products")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--span-mb", type=float, default=512, help="weight bytes a chain reads (several times L2)")
    ap.add_argument("--persistent", nargs="+", default=["1,1024,8,0,0", "1,2048,16,0,2", "2,512,8,0,2"],
                    help="persistent launches, each 'programs per SM,block_k (0: whole row),warps,prefetch,poll "
                         "(0 atomic, 1 acquire load, 2 _chain_ahead)'")
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
        variants = [("launches", launches), ("cublas", cublas)]
        for spec in args.persistent:
            per_sm, block_k, warps, prefetch, poll = (int(v) for v in spec.split(","))
            variants.append((f"persistent_{spec.replace(',', '_')}",
                             lambda p=per_sm * sms, b=block_k, w=warps, f=bool(prefetch), q=poll:
                             chain(ws, x, counter, p, f, out, b, w, q)))
        for name, fn in variants:
            got = fn()
            row[f"{name}_max_diff"] = (got.float() - want.float()).abs().max().item()
            row[f"{name}_us"] = graph_seconds(fn, calls=1) / layers * 1e6
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
