"""What speculation costs the steps that do not speculate: plain decoding beside an idle EAGLE-3 draft.

An engine with a draft that never drafts (the threshold policy at 0: `k0`) still runs the draft's share of
every plain-decode step (eagle3_follow.py: the draft KV of each decoded position, beside the model in its
CUDA graph) and the engine's speculation bookkeeping on the host. Per batch size, this measures beside a
plain engine (no draft) on the same shape and dummy weights:
- decode tokens/s through the whole engine (overlap on: the host's work hides behind the device's);
- the device time of one plain-decode graph replay (event-timed), with and without the draft's share;
so that what k0 loses splits into device time (the graph) and the host's (the rest).

    python benchmarks/follow_cost.py --batches 64 256 --out follow_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from gpu_decode import decode_rate, time_events  # noqa: E402

from specserve.models.config import ArchConfig, read_config  # noqa: E402

CONFIGS = {
    "plain": dict(speculative_algorithm="none"),
    "k0": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_policy="threshold",
               speculative_disable_batch_threshold=0),
}


def measure(args, name: str, arch: ArchConfig) -> dict:
    from specserve import LLM

    options = dict(CONFIGS[name])
    if name != "plain":
        options["speculative_draft_model_path"] = args.draft
    t0 = time.perf_counter()
    llm = LLM(args.config, load_format="dummy", dtype="bfloat16", max_model_len=args.context + args.gen_len + 32,
              max_num_seqs=max(args.batches), max_num_batched_tokens=8192, kv_host_ratio=0.0, **options)
    engine, out = llm.engine, {"startup_s": time.perf_counter() - t0, "batches": {}}
    gen = torch.Generator().manual_seed(0)
    graphs = engine.runner.graphs
    for batch in args.batches:
        rates = [decode_rate(engine, batch, args.context, args, arch, gen) for _ in range(args.rounds)]
        bs = next(b for (b, q) in sorted(graphs.graphs) if q == 1 and b >= batch)
        graphs.seq_lens[:bs].fill_(args.context)
        graphs.slots[:bs].fill_(graphs.scratch_slot)
        replay_s = time_events(graphs.graphs[(bs, 1)].replay, 30)
        out["batches"][batch] = {"tokens_per_s": max(rates), "rounds": rates, "step_ms": 1e3 * batch / max(rates),
                                 "graph": bs, "replay_ms": replay_s * 1e3}
        print(f"{name:6s} batch {batch:4d}: {max(rates):9,.0f} tok/s, step {1e3 * batch / max(rates):6.2f} ms, "
              f"graph replay {replay_s * 1e3:6.2f} ms", flush=True)
    del llm, engine, graphs
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "llama-3.1-8b"))
    ap.add_argument("--draft", default=os.path.join(HERE, "configs", "llama-3.1-8b-eagle3"))
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="follow_cost.json")
    args = ap.parse_args()
    arch = ArchConfig.from_dict(read_config(args.config))
    result = {"device": torch.cuda.get_device_name(), "context": args.context, "gen_len": args.gen_len}
    for name in CONFIGS:
        result[name] = measure(args, name, arch)
    for batch in args.batches:
        p, k = result["plain"]["batches"][batch], result["k0"]["batches"][batch]
        print(f"batch {batch}: k0 / plain tokens/s {k['tokens_per_s'] / p['tokens_per_s']:.3f}; step "
              f"+{k['step_ms'] - p['step_ms']:.2f} ms of which graph replay +{k['replay_ms'] - p['replay_ms']:.2f} ms")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
