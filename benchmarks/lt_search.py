"""Beyond cuBLASLt's heuristic: configurations of the 8B shape's decoder products at a batch's rows, each accepted by
cuBLASLt's own check, timed against F.linear. Three sources, in order:
- the heuristic's candidates (what `cublaslt._tune` times first);
- its first 12 with split-K (1-8 ways, each reduction scheme), CTA swizzle and cluster shape changed;
- every algorithm id cuBLASLt lists for bf16, at each tile, stage count and cluster shape its capabilities allow.

    python benchmarks/lt_search.py --rows 256 --seconds 105 --out lt_search.json

Quick timing as the engine's tuning times (`cublaslt._seconds`: 20 calls on one weight, in a CUDA graph unless
`cublaslt.IN_GRAPH` is off), so shapes whose weights fit in L2 read faster than in a decode step; `lt_algos.py`
times the heuristic and `LtMatmul.variants` under sustained load. Each shape gets a share of --seconds (half to the
first).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gemm_rows import SHAPES  # noqa: E402

from specserve.layers import cublaslt as lt  # noqa: E402

_CAP_SPLITK, _CAP_TILES, _CAP_STAGES = 0, 6, 13  # cublasLtMatmulAlgoCapAttributes_t


def quick_us(fn) -> float:
    return lt._seconds(fn, calls=20) * 1e6


def cap(algo: lt.Algo, attr: int, array: bool) -> list[int] | int:
    """A capability of the algorithm: a uint32 array (tiles, stages) or one int32."""
    written = ctypes.c_size_t(0)
    lib = lt.library()
    if not array:
        value = ctypes.c_int32(0)
        lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), ctypes.c_size_t(4),
                                              ctypes.byref(written))
        return value.value
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, ctypes.c_size_t(0),
                                             ctypes.byref(written)) or written.value < 4:
        return []
    values = (ctypes.c_uint32 * (written.value // 4))()
    lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, ctypes.c_size_t(written.value),
                                          ctypes.byref(written))
    return list(values)


def listed_ids() -> list[tuple[int, lt.Algo]]:
    """Every bf16 algorithm id cuBLASLt lists, initialised."""
    types = (lt._COMPUTE_32F, lt._R_32F, lt._R_16BF, lt._R_16BF, lt._R_16BF, lt._R_16BF)
    ids, found = (ctypes.c_int * 512)(), ctypes.c_int(0)
    lib = lt.library()
    lib.cublasLtMatmulAlgoGetIds(lt._handle, *types, 512, ids, ctypes.byref(found))
    out = []
    for algo_id in list(ids)[:found.value]:
        algo = lt.Algo()
        if not lib.cublasLtMatmulAlgoInit(lt._handle, *types, algo_id, ctypes.byref(algo)):
            out.append((algo_id, algo))
    return out


def search(name: str, k: int, n: int, rows: int, deadline: float) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    want = F.linear(x, w).float()
    tolerance = 16 * torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    mm = lt.LtMatmul(rows, n, k)
    workspace = torch.empty(mm.workspace_bytes, dtype=torch.uint8, device="cuda")
    torch_us = [quick_us(lambda: F.linear(x, w))]
    timed, seen = [], set()

    def trial(algo: lt.Algo | None, origin: str) -> None:
        need = mm.check(algo)
        config = None if need is None else lt.algo_config(algo)
        if config is None or tuple(config.items()) in seen or time.time() > deadline:
            return
        seen.add(tuple(config.items()))
        try:
            mm.run(x, w, y, algo, workspace)
            error = (y.float() - want).abs().max().item()
            us = quick_us(lambda: mm.run(x, w, y, algo, workspace))
        except lt.CublasLtError as e:
            timed.append({"origin": origin, "config": config, "error": str(e)})
            return
        timed.append({"origin": origin, "config": config, "us": us, "correct": error <= tolerance, "workspace": need})

    heuristic = [algo for algo, _ in mm.candidates(32)]
    for i, algo in enumerate(heuristic):
        trial(algo, f"h{i}")
    for i, base in enumerate(heuristic[:12]):
        for split in (1, 2, 3, 4, 6, 8):
            for reduction in ((0,) if split == 1 else (1, 2, 4)):
                for swizzle in (0, 1):
                    for cluster in (None, 0, 2, 3, 5, 6):
                        extra = {} if cluster is None else {"cluster": cluster}
                        trial(lt.configured(base, split_k=split, reduction=reduction, swizzle=swizzle, **extra),
                              f"h{i}/split{split}/reduction{reduction}/swizzle{swizzle}/cluster{cluster}")
    for algo_id, base in listed_ids():
        splits = (1, 2, 4) if cap(base, _CAP_SPLITK, False) else (1,)
        for tile in cap(base, _CAP_TILES, True) or [0]:
            for stages in cap(base, _CAP_STAGES, True) or [0]:
                for cluster in (0, 2, 3):
                    for split in splits:
                        trial(lt.configured(base, tile=tile, stages=stages, cluster=cluster, split_k=split,
                                         reduction=2 if split > 1 else 0), f"id{algo_id}")
    torch_us.append(quick_us(lambda: F.linear(x, w)))
    best = sorted((t for t in timed if t.get("correct")), key=lambda t: t["us"])
    print(f"{name}: torch {min(torch_us):.1f}-{max(torch_us):.1f} us, heuristic best "
          f"{min(t['us'] for t in timed if t['origin'] in {f'h{i}' for i in range(len(heuristic))}):.1f}; "
          f"{len(timed)} configurations timed, fastest:", flush=True)
    for t in best[:8]:
        print(f"   {t['us']:7.1f} us  {t['origin']:>40}  {t['config']}", flush=True)
    return {"shape": name, "rows": rows, "k": k, "n": n, "torch_us": torch_us, "timed": timed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--seconds", type=float, default=105.0, help="the search's whole time")
    ap.add_argument("--out", default="lt_search.json")
    args = ap.parse_args()
    results = []
    for i, name in enumerate(args.shapes):
        share = 0.5 if i == 0 else 0.5 / max(1, len(args.shapes) - 1)
        results.append(search(name, *SHAPES[name], args.rows, time.time() + args.seconds * share))
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
