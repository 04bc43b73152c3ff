"""What the logits processors cost a decode step: a plain engine on the shipped target with `--batch` greedy
requests in flight, every request asking for one option set, against none, rounds interleaved.

    python benchmarks/processor_cost.py [--device cuda] [--batch 8 64] [--steps 200] [--rounds 3] [--out cost.json]

Option sets: `penalties` (repetition 1.1, frequency 0.2, presence 0.1), `bad_words` (4 words of 1-3 tokens, each
tokenized alone and after a space), `bad_words_32` (32 words). Reports the wall time per steady step and its
ratio to `none`'s in the same round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

WORDS = ["return", "import os", "self.assertEqual", "raise ValueError"]
OPTIONS = {
    "none": {},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1},
    "bad_words": {"bad_words": WORDS},
    "bad_words_32": {"bad_words": WORDS + [f"name{i}" for i in range(28)]},
}


def main() -> None:
    from k0_step import steady_step_seconds  # benchmarks/ is on sys.path when run as a script

    from specserve.assets import SHIPPED_TARGET
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = ["none"] + [n for n in args.options if n != "none"]
    out = {"device": args.device, "steps": args.steps, "batches": []}
    for batch in args.batch:
        engine = LLMEngine(EngineConfig.from_options(model=SHIPPED_TARGET, device=args.device, max_num_seqs=batch,
                                                     speculative_algorithm="none"))
        times: dict = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                seconds = steady_step_seconds(engine, args.steps, batch, lambda i: {"temperature": 0, **OPTIONS[name]})
                times[name].append(round(1e6 * seconds, 1))
        ratios = {name: [round(t / base, 3) for t, base in zip(times[name], times["none"])] for name in names[1:]}
        out["batches"].append({"batch": batch, "step_us": times, "over_none": ratios})
        print(json.dumps(out["batches"][-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
