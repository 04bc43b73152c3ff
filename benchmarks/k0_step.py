"""What a plain decode step costs in an engine with speculation enabled, against a plain engine.

    python benchmarks/k0_step.py [--steps 300] [--concurrency 1,8,64] [--rounds 3]

Builds the shipped target alone and with the shipped EAGLE-3 draft at k = 0 (the threshold policy with
threshold 0: speculation on, never drafting), then per engine: the device time of one replay of the
plain-decode CUDA graph at batch 1, 8 and 64 (CUDA events, 200 replays), and the wall time per step of
steady decoding at each concurrency (rounds interleaved between the engines). With the draft following
plain decoding inside the graph (speculative/eagle3_follow.py) the difference is the follow's kernels
and the host's per-step work. CUDA only.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams


def build(spec: bool) -> LLMEngine:
    opts = dict(model=SHIPPED_TARGET, device="cuda", speculative_algorithm="none")
    if spec:
        opts.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=SHIPPED_DRAFT, speculative_num_steps=3,
                    speculative_policy="threshold", speculative_disable_batch_threshold=0)
    return LLMEngine(EngineConfig.from_options(**opts))


def steady_step_seconds(engine: LLMEngine, steps: int, concurrency: int, options=None) -> float:
    """Wall seconds per step of `concurrency` requests decoding steadily, without EOS: greedy, or with
    `options` given, request i with SamplingParams(**options(i))."""
    for i in range(concurrency):
        extra = options(i) if options is not None else {"temperature": 0}
        engine.add_request([5 + i % 50, 6, 7, 8, 9, 10, 11, 12] * 8,
                           SamplingParams(max_tokens=steps + 50, ignore_eos=True, **extra))
    for _ in range(20):
        engine.step()
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return seconds


def replay_us(engine: LLMEngine, bs: int, replays: int = 200) -> float:
    graph = engine.runner.graphs.graphs[(bs, 1)]
    for _ in range(10):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / replays * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {"plain": build(False), "k0": build(True)}
    out = {name: {"replay_us": {bs: round(replay_us(e, bs), 1) for bs in (1, 8, 64)}} for name, e in engines.items()}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for c in levels:
                seconds = steady_step_seconds(engine, args.steps, c)
                out[name].setdefault(f"step_us_c{c}", []).append(round(seconds * 1e6, 1))
    print(json.dumps(out, indent=1))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
