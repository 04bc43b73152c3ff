"""What a prefix hit costs the EAGLE-3 draft, for the design shipped and the alternatives.

    python benchmarks/prefix_draft_cost.py [--prefix-tokens 1024] [--new-tokens 64] [--trials 8] [--device cpu]

A request resends a cached prefix plus new tokens. Times its first step (the target's prefill of what is
not cached: TTFT) and its second (the first speculative step: the draft catches up on every pair it has
not seen, then drafts and the target verifies), median over trials, for

- cached (shipped): the whole prefix hits; the draft starts from the block's cached boundary feature, so
  it catches up on 1 + new pairs;
- hit one block shorter: the target recomputes the last cached block (and the draft its pairs). A design
  without cached features must recompute the target at the last cached position at least (ending the hit
  one token early, copy-on-write of that block); this row bounds what that costs;
- off: no caching (prefill, and a draft catch-up over every pair: what keeping every position's feature
  instead of the KV would cost the draft on each hit).

Also prints the memory per block of the target KV, the draft KV, the boundary feature, and of keeping
every position's target feature.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams


def two_steps(engine: LLMEngine, prompt: list[int]) -> tuple[float, float]:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    options = dict(model=SHIPPED_TARGET, speculative_algorithm="EAGLE3", speculative_draft_model_path=SHIPPED_DRAFT,
                   speculative_policy="always", device=args.device, max_model_len=2048)
    cached = LLMEngine(EngineConfig.from_options(**options))
    off = LLMEngine(EngineConfig.from_options(**options, enable_prefix_caching=False))
    prefix = [5 + (i * 7919) % 4000 for i in range(args.prefix_tokens)]
    two_steps(cached, prefix + [1])  # cache the prefix (and warm up)
    two_steps(off, prefix + [1])
    full_match = cached.blocks.match
    short_match = lambda seq: _drop_last(full_match(seq))  # noqa: E731
    rows: dict[str, list[tuple[float, float]]] = {"cached (shipped)": [], "hit one block shorter": [], "off": []}
    runs = {"cached (shipped)": (cached, full_match), "hit one block shorter": (cached, short_match),
            "off": (off, None)}
    for trial in range(args.trials):
        new = [5 + (trial * 131 + j * 17) % 4000 for j in range(args.new_tokens)]
        names = list(runs)[trial % 3:] + list(runs)[:trial % 3]  # rotate the order: noise hits all alike
        for name in names:
            engine, match = runs[name]
            if match is not None:
                engine.blocks.match = match
            rows[name].append(two_steps(engine, prefix + new))
    print(f"prefix {args.prefix_tokens} tokens cached, {args.new_tokens} new; median of {args.trials} (ms)\n")
    print("| design | first step (TTFT) | first speculative step (draft catch-up + verify) |\n|---|---|---|")
    for name, pairs in rows.items():
        print(f"| {name} | {1000 * statistics.median(p[0] for p in pairs):.1f} | "
              f"{1000 * statistics.median(p[1] for p in pairs):.1f} |")
    runner, proposer, bs = cached.runner, cached.spec.proposer, cached.config.cache.block_size
    target_kv = runner.kv_cache[:, :, :bs].numel()
    draft_kv = proposer.kv_cache[:, :, :bs].numel()
    feature = proposer.block_features.shape[1]
    print(f"\nvalues per block of {bs} tokens: target KV {target_kv}, draft KV {draft_kv}, boundary feature {feature} "
          f"(+{100 * feature / (target_kv + draft_kv):.1f}%); every position's feature instead: {bs * feature} "
          f"(+{100 * bs * feature / (target_kv + draft_kv):.0f}%)")


def _drop_last(hit):
    hit.nodes = hit.nodes[:-1]
    return hit


if __name__ == "__main__":
    main()
