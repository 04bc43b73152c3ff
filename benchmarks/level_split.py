"""Where a sweep level's time goes: decode-only steps against steps with a prefill, per configuration.

    python benchmarks/level_split.py [--device cuda] [--levels 5,10,30] [--requests 30] [--max-tokens 100]
        [--rounds 2] [--configs plain,chain,chain_pp,adaptive] [--dataset rich.jsonl --fresh]

The shipped pair, held-out standard-library prompts (128 tokens) or a JSONL file of {"prompt": ...} lines
(`benchmarks/package_prompts.py`; `--fresh`: each request a prompt not used before, as the server bench's
`--fresh-prompts`), closed-loop levels of `--requests` requests, rounds interleaved between configurations.
Per configuration (plain, chain-3, adaptive, k0 = speculation on but never drafting, and chain-3 with
every step that admits or continues a prefill decoding plain, as adaptive does: `chain_pp`) the throughput, the
count and wall time of decode-only steps and of steps with a prefill, and the accepted drafts per verify.
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time

sys.path.insert(0, "benchmarks")
from default_pair import held_out_texts  # noqa: E402
from sweep import configurations  # noqa: E402

from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402
from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.speculative.shapes import PLAIN  # noqa: E402


def build(name: str, device: str, max_seqs: int) -> LLMEngine:
    opts = configurations(SHIPPED_DRAFT)[name.replace("_pp", "")]
    engine = LLMEngine(EngineConfig.from_options(model=SHIPPED_TARGET, device=device, max_num_seqs=max_seqs, **opts))
    if name.endswith("_pp"):  # plain decoding in every step that carries a prefill
        choose = engine.spec.choose

        def plain_with_prefills(batch_size: int, prefill=None) -> object:
            return PLAIN if prefill is not None and prefill() else choose(batch_size, prefill)
        engine.spec.choose = plain_with_prefills
    return engine


class Prompts:
    """Token-id prompts in order; `fresh`: none handed out twice (the prefix cache cannot serve them)."""

    def __init__(self, ids: list[list[int]], fresh: bool):
        self.ids, self.fresh, self.next = ids, fresh, 0

    def take(self, i: int) -> list[int]:
        if not self.fresh:
            return self.ids[i % len(self.ids)]
        self.next += 1
        return self.ids[(self.next - 1) % len(self.ids)]


def level(engine: LLMEngine, concurrency: int, total: int, max_tokens: int, prompts: Prompts) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    issued = finished = tokens = 0
    split = {"decode": [0, 0.0], "prefill": [0, 0.0]}  # steps, seconds
    d0, a0 = engine.stats.spec.num_drafts, engine.stats.spec.num_accepted_tokens
    start = time.perf_counter()
    while finished < total:
        while issued < total and issued - finished < concurrency:
            engine.add_request(prompts.take(issued), params)
            issued += 1
        p0, t0 = engine.stats.num_prompt_tokens, time.perf_counter()
        outs = engine.step()
        kind = "prefill" if engine.stats.num_prompt_tokens > p0 else "decode"
        split[kind][0] += 1
        split[kind][1] += time.perf_counter() - t0
        for out in outs:
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
    seconds = time.perf_counter() - start
    drafts, accepted = engine.stats.spec.num_drafts - d0, engine.stats.spec.num_accepted_tokens - a0
    return {"output_throughput": tokens / seconds, "seconds": seconds, "decode_steps": split["decode"][0],
            "decode_s": split["decode"][1], "prefill_steps": split["prefill"][0], "prefill_s": split["prefill"][1],
            "drafts": drafts, "accepted_per_draft": accepted / drafts if drafts else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default="5,10,30")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="plain,chain,chain_pp,adaptive")
    ap.add_argument("--dataset", default=None, help="a JSONL file of {\"prompt\": ...} lines")
    ap.add_argument("--fresh", action="store_true", help="never hand out a prompt twice")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    engines = {name: build(name, args.device, max(levels)) for name in args.configs.split(",")}
    tok = next(iter(engines.values())).tokenizer
    if args.dataset:
        texts = [json.loads(line)["prompt"] for line in open(args.dataset) if line.strip()]
        ids = [tok.encode(t) for t in texts]
    else:
        ids = [tok.encode(text[:2000])[:128] for _, text in held_out_texts(sysconfig.get_paths()["stdlib"], 94)]
    prompts = {name: Prompts(ids, args.fresh) for name in engines}  # every configuration the same prompts
    warm = Prompts(ids[::-1], False)
    for engine in engines.values():
        level(engine, 2, 4, 16, warm)
    results: dict = {}
    for c in levels:
        for rnd in range(args.rounds):
            base = None
            for name, engine in engines.items():
                r = level(engine, c, max(args.requests, c), args.max_tokens, prompts[name])
                results.setdefault(name, {}).setdefault(c, []).append(r)
                base = base or r["output_throughput"]
                print(f"C={c} r{rnd} {name:12s} {r['output_throughput']:8.0f} tok/s "
                      f"({r['output_throughput'] / base:.2f}x)  decode steps {r['decode_steps']:4d} "
                      f"{r['decode_s'] * 1e3:7.1f} ms  prefill steps {r['prefill_steps']:3d} "
                      f"{r['prefill_s'] * 1e3:7.1f} ms  drafts {r['drafts']} accepted/draft "
                      f"{r['accepted_per_draft']:.2f}", flush=True)
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
