"""Seeded sampling (Gumbel-max keyed by seed and position) against rejection sampling, side by side.

    python benchmarks/seeded_sampling.py [--device cuda] [--prompts 24] [--max-tokens 128]
        [--step-model tiny|8b] [--batch 64] [--steps 200] [--rounds 3] [--out seeded.json]

Acceptance: the shipped pair, a chain of 3 drafts on every step, temperature 1, the held-out standard-library
prompts of `default_pair.py`; each prompt once with a seed (seed = its index) and once without (rejection
sampling with the global generator). Reports the mean acceptance length (1 + accepted drafts per verify)
of each. A seeded verify accepts a draft exactly when it equals the Gumbel-max token of its position, which
for a point-mass draft has the probability p(draft), as rejection sampling's acceptance does: the two
lengths should agree within noise.

Step cost: a plain engine (`--step-model`: the shipped target, or the Llama-3.1-8B shape with dummy weights)
with `--batch` requests in flight at temperature 1, all seeded or none, wall time per steady decode step,
rounds interleaved between the two.
"""
from __future__ import annotations

import argparse
import json
import os
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))


def acceptance(device: str, prompts: int, max_tokens: int, stdlib: str) -> dict:
    from default_pair import held_out_texts  # benchmarks/ is on sys.path when run as a script

    from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    llm = LLM(SHIPPED_TARGET, device=device, speculative_algorithm="EAGLE3", speculative_num_steps=3,
              speculative_draft_model_path=SHIPPED_DRAFT, speculative_policy="always")
    texts = [text[:600] for _, text in held_out_texts(stdlib, prompts)]
    if not texts:
        raise SystemExit(f"no held-out files under {stdlib}: pass --stdlib")
    out = {}
    for name in ("rejection", "seeded"):
        spec = llm.engine.stats.spec
        drafts, accepted = spec.num_drafts, spec.num_accepted_tokens
        for i, text in enumerate(texts):
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i if name == "seeded" else None)
            llm.generate([text], params)
        drafts, accepted = spec.num_drafts - drafts, spec.num_accepted_tokens - accepted
        out[name] = {"verifies": drafts, "accept_length": round(1 + accepted / max(drafts, 1), 4)}
    return out


def step_engine(which: str, device: str, batch: int):
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    if which == "8b":
        opts = dict(model=os.path.join(HERE, "configs", "llama-3.1-8b"), load_format="dummy", max_model_len=1024)
    else:
        from specserve.assets import SHIPPED_TARGET

        opts = dict(model=SHIPPED_TARGET)
    return LLMEngine(EngineConfig.from_options(device=device, speculative_algorithm="none", max_num_seqs=batch,
                                               **opts))


def main() -> None:
    from k0_step import steady_step_seconds  # benchmarks/ is on sys.path when run as a script

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="where the held-out files are")
    ap.add_argument("--step-model", default="tiny", choices=("tiny", "8b"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip", default="", help="acceptance or step: a part not to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict = {}
    if args.skip != "acceptance":
        out["acceptance"] = acceptance(args.device, args.prompts, args.max_tokens, args.stdlib)
        print(json.dumps(out["acceptance"]))
    if args.skip != "step":
        engine = step_engine(args.step_model, args.device, args.batch)
        times: dict = {"unseeded": [], "seeded": []}
        for _ in range(args.rounds):
            for name in times:  # seeded: request i has seed i; unseeded: all temperature 1 without a seed
                seconds = steady_step_seconds(engine, args.steps, args.batch,
                                              lambda i: {"temperature": 1.0, "seed": i if name == "seeded" else None})
                times[name].append(round(1e6 * seconds, 1))
        median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        out["step"] = {"model": args.step_model, "batch": args.batch, "step_us": times,
                       "seeded_over_unseeded": round(median["seeded"] / median["unseeded"], 4)}
        print(json.dumps(out["step"]))
    if args.out:
        json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
