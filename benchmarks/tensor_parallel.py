"""Step time and output tokens/s of one rank against two, per configuration, with the share of each step
rank 0 spent waiting in collectives (all-reduce, all-gather, sending the step's call) and the time the
EAGLE-3 head (on rank 0 alone) takes per speculative step.

    python benchmarks/tensor_parallel.py [--tp 2] [--batch 1,4] [--max-tokens 48] [--device cpu|cuda]
                                         [--threads N]

`--threads` sets rank 0's torch threads before anything starts (on a busy CPU, 1 avoids OpenMP's
pathologies); the ranks then split what they were given. The adaptive row also reports the k it chose on
average over decode steps.
"""
from __future__ import annotations

import argparse
import time

import torch

from specserve import LLM, SamplingParams
from specserve.engine.distributed import Ranks
from specserve.layers.parallel import TensorParallel

PROMPTS = ["def read_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n", "    def __repr__(self):\n"]
CONFIGURATIONS = {
    "plain": dict(speculative_algorithm="none"),
    "chain": dict(speculative_policy="always"),
    "adaptive": dict(),
}
waited = [0.0]


def timed(cls, name: str) -> None:
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            waited[0] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def measure(tp: int, batch: int, max_tokens: int, device: str, options: dict) -> dict:
    llm = LLM(None, tensor_parallel_size=tp, device=device, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(PROMPTS[:batch], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm
        stats = llm.engine.stats
        steps, tokens, k_sum, k_steps = stats.num_steps, stats.num_generation_tokens, 0, 0
        draft_s, drafting = stats.spec.draft_time_s, 0
        waited[0] = 0.0
        t0 = time.perf_counter()
        for p in PROMPTS[:batch]:
            llm.engine.add_request(p, params)
        while llm.engine.has_unfinished():
            llm.engine.step()
            k_sum, k_steps, drafting = k_sum + stats.spec.last_k, k_steps + 1, drafting + (stats.spec.last_k > 0)
        seconds = time.perf_counter() - t0
        steps = stats.num_steps - steps
        return dict(ms_per_step=1000 * seconds / steps, tok_s=(stats.num_generation_tokens - tokens) / seconds,
                    comm=waited[0] / seconds, mean_k=k_sum / k_steps,
                    draft_ms=1000 * (stats.spec.draft_time_s - draft_s) / max(1, drafting))
    finally:
        llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for cls, name in ((TensorParallel, "all_reduce"), (TensorParallel, "all_gather"), (Ranks, "send")):
        timed(cls, name)
    print("| batch | configuration | ranks | ms / step | output tok/s | rank 0 in collectives | mean k | "
          "draft ms / speculative step |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in map(int, args.batch.split(",")):
        for name, options in CONFIGURATIONS.items():
            for tp in (1, args.tp):
                r = measure(tp, batch, args.max_tokens, args.device, options)
                print(f"| {batch} | {name} | {tp} | {r['ms_per_step']:.1f} | {r['tok_s']:.1f} | "
                      f"{100 * r['comm']:.0f}% | {r['mean_k']:.2f} | {r['draft_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
