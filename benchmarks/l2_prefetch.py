"""Whether a layer's next weights, pulled into L2 on a side stream while latency-bound kernels run, make the product
that reads them faster: the one-row GEMV (`triton_gemv.gemv`) of each weight shape, as CUDA graphs cycling
through copies of the weights (so none starts in L2):
- cold: the GEMV alone; hot: the same weights read again (all in L2);
- prefetch: the L2 prefetch kernel alone (`prefetch.global.L2::evict_last` per 128-byte line, or loads);
- serial: a latency-bound stand-in (`--spin-us` of dependent arithmetic on a few programs, as a decode step's
  attention, rope or routing kernels at batch 1) then the GEMV;
- overlapped: the stand-in with the prefetch beside it on a side stream, joined before the GEMV.
What overlap could win a layer is serial - overlapped, at most cold - hot.

    python benchmarks/l2_prefetch.py --out l2_prefetch.json
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

from attention_kernel import graph_seconds  # noqa: E402

from specserve.layers import triton_gemv  # noqa: E402

SHAPES = {  # name: [N, K] of a one-row product's weight
    "30b-a3b qkv": (5120, 2048), "30b-a3b o": (2048, 4096), "8b qkv": (6144, 4096), "8b o": (4096, 4096),
}
SPAN = 512 * 2**20  # bytes of weight copies a graph cycles through (L2 is 50 MB)
LINE = 64  # bf16 elements in a 128-byte line


@triton.jit
def _prefetch_asm(W, lines, flag, Sink, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptrs = W + tl.minimum(i, lines - 1).to(tl.int64) * 64
    r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.store(Sink + i, r, mask=(i < lines) & (flag != 0))


@triton.jit
def _prefetch_load(W, lines, flag, Sink, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(W + tl.minimum(i, lines - 1).to(tl.int64) * 64, eviction_policy="evict_last")
    tl.store(Sink + i, x.to(tl.int32), mask=(i < lines) & (flag != 0))


@triton.jit
def _spin(Sink, iters, flag):
    x = tl.program_id(0).to(tl.float32)
    for _ in range(iters):
        x = x * 0.999 + 0.5
    tl.store(Sink + tl.program_id(0), x.to(tl.int32), mask=flag != 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--spin-us", type=float, nargs="+", default=[5.0, 10.0])
    ap.add_argument("--spin-programs", type=int, default=8)
    ap.add_argument("--out", default="l2_prefetch.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sink = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    block = 1024

    def prefetch(w: torch.Tensor, kind: str) -> None:
        lines = w.numel() // LINE
        kernel = _prefetch_asm if kind == "asm" else _prefetch_load
        kernel[(triton.cdiv(lines, block),)](w, lines, 0, sink, BLOCK=block, num_warps=4)

    def spin(iters: int) -> None:
        _spin[(args.spin_programs,)](sink, iters, 0, num_warps=1)

    probe = 4096
    per_iter = graph_seconds(lambda: spin(probe), calls=4) / probe
    result = {"device": torch.cuda.get_device_name(), "spin_ns_per_iter": per_iter * 1e9, "rows": []}
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(2, SPAN // (n * k * 2))
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)

        def each(step) -> float:
            return graph_seconds(lambda: [step(w) for w in ws], calls=1) / copies * 1e6

        row = {"shape": name, "mb": n * k * 2 / 1e6, "copies": copies}
        row["cold_us"] = each(lambda w: triton_gemv.gemv(x, w))
        row["hot_us"] = graph_seconds(lambda: triton_gemv.gemv(x, ws[0]), calls=16) * 1e6
        for kind in ("asm", "load"):
            row[f"prefetch_{kind}_us"] = each(lambda w: prefetch(w, kind))
            row[f"prefetch_{kind}_then_gemv_us"] = each(lambda w: (prefetch(w, kind), triton_gemv.gemv(x, w)))
        for spin_us in args.spin_us:
            iters = max(1, int(spin_us * 1e-6 / per_iter))

            def overlapped(w, kind, iters=iters):
                main_stream = torch.cuda.current_stream()
                side.wait_stream(main_stream)
                with torch.cuda.stream(side):
                    prefetch(w, kind)
                spin(iters)
                main_stream.wait_stream(side)
                triton_gemv.gemv(x, w)

            cell = {"spin_us": spin_us, "spin_alone_us": each(lambda w, i=iters: spin(i)),
                    "serial_us": each(lambda w, i=iters: (spin(i), triton_gemv.gemv(x, w)))}
            for kind in ("asm", "load"):
                cell[f"overlapped_{kind}_us"] = each(lambda w, kind=kind: overlapped(w, kind))
            row[f"spin_{spin_us:g}"] = cell
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
