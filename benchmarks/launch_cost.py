"""What a kernel boundary costs on a GPU, against a grid-wide barrier inside one resident kernel: the question a
persistent kernel per decoder layer (launches replaced by barriers) has to answer first.

    python benchmarks/launch_cost.py --out launch_cost.json

`launch`: a CUDA graph of 64 launches of a small Triton kernel (each program: LOADS dependent loads, then a
store), per launch, for each programmatic-dependent-launch mode (`triton_launch.MODE`) and grid. `barrier`: one
kernel of the same grid, every program resident, doing the same loads then passing a grid-wide barrier (atomic
arrival, the last arrival flips a generation flag the others spin on), 64 times, per barrier.
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

from specserve.layers import triton_launch  # noqa: E402
from specserve.layers.triton_launch import launch_kernel, let_next_launch, wait_for_previous  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

STEPS = 64

if triton is not None:
    @triton.jit
    def _step(X, N, LOADS: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # a latency-bound kernel's shape: LOADS dependent loads from X [N], then a store
        v = tl.load(X + tl.program_id(0))
        for _ in tl.static_range(LOADS - 1):
            v = tl.load(X + (v.to(tl.int32) % N))
        let_next_launch(PDL)
        tl.store(X + tl.program_id(0), v)

    @triton.jit
    def _barriers(X, Count, Flag, N, ROUNDS: tl.constexpr, LOADS: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous(PDL)
        # ROUNDS x (_step's loads and store, then a grid-wide barrier); every program must be resident at once
        i = tl.program_id(0)
        for r in range(ROUNDS):
            v = tl.load(X + i, volatile=True)
            for _ in tl.static_range(LOADS - 1):
                v = tl.load(X + (v.to(tl.int32) % N), volatile=True)
            tl.store(X + i, v)
            generation = tl.atomic_add(Flag, 0, sem="acquire")
            if tl.atomic_add(Count, 1, sem="acq_rel") == tl.num_programs(0) - 1:  # the last arrival
                tl.atomic_xchg(Count, 0, sem="relaxed")
                tl.atomic_add(Flag, 1, sem="release")
            else:
                while tl.atomic_add(Flag, 0, sem="acquire") == generation:
                    pass


def measure(modes: list[int], grids: list[int], loads: list[int]) -> list[dict]:
    dev = torch.device("cuda")
    n = 4096
    x = torch.zeros(n, dtype=torch.float32, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    rows = []

    def record(row: dict, seconds: float) -> None:
        rows.append({**row, "us": seconds * 1e6})
        print(json.dumps(rows[-1]), flush=True)

    for mode in modes:
        triton_launch.MODE = mode
        for grid in grids:
            for depth in loads:
                record(dict(kind="launch", mode=mode, grid=grid, loads=depth),
                       graph_seconds(lambda: [launch_kernel(_step, (grid,), x, n, LOADS=depth, num_warps=4)
                                              for _ in range(STEPS)], calls=1) / STEPS)
    triton_launch.MODE = 3
    for grid in grids:
        for depth in loads:
            record(dict(kind="barrier", grid=grid, loads=depth),
                   graph_seconds(lambda: launch_kernel(_barriers, (grid,), x, count, flag, n, ROUNDS=STEPS,
                                                       LOADS=depth, num_warps=4), calls=4) / STEPS)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", type=int, nargs="+", default=[0, 3, 1], help="triton_launch.MODE values for `launch`")
    ap.add_argument("--grids", type=int, nargs="+", default=[1, 16, 132, 264],
                    help="programs a kernel (the barrier kernel needs them all resident: keep to 2 a multiprocessor)")
    ap.add_argument("--loads", type=int, nargs="+", default=[1, 3], help="dependent loads a program")
    ap.add_argument("--out", default="launch_cost.json")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "steps": STEPS,
              "rows": measure(args.modes, args.grids, args.loads)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
