"""What a decode step costs when its requests run LoRA adapters, against the same requests on the base model.

    python benchmarks/lora_overhead.py [--device cpu] [--batches 1,8] [--rank 16] [--steps 60] [--rounds 3]

One engine serves the model (the shipped target by default) with a random adapter of the given rank on every
projection (q/k/v/o, gate/up/down; `models/lora.random_adapter`). Per round and batch size, interleaved: the
wall seconds per step of steady greedy decoding of `batch` requests on the base model, all on the adapter, and
half and half (rows on the adapter, rows on the base model). Every adapted layer adds the deltas of all
`--max-loras` slots with a mask (layers/lora.py). On CUDA every step replays a CUDA graph (adapter steps their
adapter twins); `--enforce-eager` runs them all eagerly.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

from specserve.assets import SHIPPED_TARGET
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.engine.sequence import RequestOptions
from specserve.models.lora import random_adapter
from specserve.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXES = {"base": lambda i: None, "adapter": lambda i: "a", "half": lambda i: "a" if i % 2 else None}


def step_seconds(engine: LLMEngine, batch: int, steps: int, lora) -> float:
    """Wall seconds per step of `batch` requests decoding steadily (request i on adapter lora(i))."""
    for i in range(batch):
        engine.add_request([5 + i % 50, 6, 7, 8, 9, 10, 11, 12] * 8,
                           SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True),
                           options=RequestOptions(lora=lora(i)))
    for _ in range(10):  # prompts, then a few decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    while engine.has_unfinished():
        engine.step()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=SHIPPED_TARGET)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-loras", type=int, default=1, help="adapter slots every adapted layer computes")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        adapter = random_adapter(f"{tmp}/a", args.model, TARGETS, args.rank, seed=0, scale=0.02)
        engine = LLMEngine(EngineConfig.from_options(model=args.model, device=args.device, lora_modules=f"a={adapter}",
                                                     max_loras=args.max_loras, enforce_eager=args.enforce_eager,
                                                     speculative_algorithm="none"))
        rows = []
        for r in range(args.rounds):
            for batch in (int(b) for b in args.batches.split(",")):
                ms = {mix: 1e3 * step_seconds(engine, batch, args.steps, lora) for mix, lora in MIXES.items()}
                rows.append({"round": r, "batch": batch, **{f"{m}_ms": round(v, 3) for m, v in ms.items()},
                             "adapter_vs_base": round(ms["adapter"] / ms["base"], 3),
                             "half_vs_base": round(ms["half"] / ms["base"], 3)})
                print(json.dumps(rows[-1]))
        engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
