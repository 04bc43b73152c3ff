"""Every algorithm cuBLASLt's heuristic offers for the 8B shape's decoder products at a batch's rows, timed under
sustained load beside the product torch issues (F.linear, cuBLAS's own pick).

Issue 23's batch-256 step spends ~5.7 ms of its ~9.2 ms of kernels in these products at ~85% of the bf16 matmul
rate; the gate/up product's 224 tiles of 256 x 128 fill 1.7 waves of 132 multiprocessors. The question: does
another algorithm (tile, split-K, stream-K) run any of these shapes faster?

    python benchmarks/lt_algos.py --rows 256 --out lt_algos.json

After the heuristic's algorithms come `LtMatmul.variants` of its first `cublaslt.VARIED` (other cluster shapes and
swizzles), as the engine's tuning times them. Each product is a CUDA graph of one call per layer on its own weight
copy (nothing read from L2), replayed for `--warm` seconds before timing, then the median of 10 replays; torch's
product is timed again every 8 algorithms.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gemm_rows import SHAPES, operands, product_arguments  # noqa: E402
from gemm_rows import sustained_seconds as sustained  # noqa: E402

from specserve.layers import cublaslt  # noqa: E402


def shape_rows(name: str, k: int, n: int, rows: int, layers: int, warm: float, count: int) -> dict:
    x, ws, ys, want, flops = operands(k, n, rows, layers)
    mm = cublaslt.LtMatmul(rows, n, k)
    workspace = torch.empty(mm.workspace_bytes, dtype=torch.uint8, device=x.device)
    algos = mm.candidates(count)
    heuristic = len(algos)
    algos += mm.variants([algo for algo, _ in algos[:cublaslt.VARIED]])
    torch_us, entries = [], []

    def time_torch():
        torch_us.append(sustained(lambda: [F.linear(x, w) for w in ws], warm) / layers * 1e6)
        print(f"{name:>8} rows {rows}: torch {torch_us[-1]:7.1f} us {flops / torch_us[-1] / 1e6:5.0f} TFLOP/s",
              flush=True)

    time_torch()
    for i, (algo, need) in enumerate(algos):
        if i and i % 8 == 0:
            time_torch()
        try:
            mm.run(x, ws[0], ys[0], algo, workspace)
            torch.cuda.synchronize()
            error = (ys[0].float() - want).abs().max().item()
            us = sustained(lambda: [mm.run(x, w, y, algo, workspace) for w, y in zip(ws, ys)], warm) / layers * 1e6
        except cublaslt.CublasLtError as e:
            entries.append({"index": i, "error": str(e)})
            continue
        entries.append({"index": i, "us": us, "tflops": flops / us / 1e6, "max_error": error, "workspace": need,
                        "config": cublaslt.algo_config(algo), "variant": i >= heuristic})
        print(f"{name:>8} rows {rows}: algo {i:2d} {us:7.1f} us {flops / us / 1e6:5.0f} TFLOP/s err {error:.2e} "
              f"{entries[-1]['config']}", flush=True)
    time_torch()
    best = min((e for e in entries if "us" in e), key=lambda e: e["us"], default=None)
    if best:
        print(f"{name:>8} rows {rows}: best algo {best['index']} {best['us']:.1f} us against torch "
              f"{min(torch_us):.1f}-{max(torch_us):.1f} ({best['us'] / min(torch_us):.3f}x)", flush=True)
    return {"shape": name, "rows": rows, "k": k, "n": n, "torch_us": torch_us, "algos": entries}


def main() -> None:
    ap = product_arguments(__doc__, "lt_algos.json", 0.25)
    ap.add_argument("--count", type=int, default=24, help="algorithms asked of the heuristic")
    args = ap.parse_args()
    results = []
    for rows in args.rows:
        for name in args.shapes:
            results.append(shape_rows(name, *SHAPES[name], rows, args.layers, args.warm, args.count))
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
