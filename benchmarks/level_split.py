"""Where a sweep level's time goes: decode-only steps against steps with a prefill, per configuration.

    python benchmarks/level_split.py [--device cuda] [--levels 5,10,30] [--requests 30] [--max-tokens 100]
        [--max-tokens-min N] [--rounds 2] [--configs plain,chain,chain_pp,adaptive]
        [--prompts heldout|builtin | --dataset rich.jsonl [--fresh]] [--host] [--out split.json]

The shipped pair, held-out standard-library prompts (128 tokens), sweep.py's eight builtin code headers (the
README's main job's dataset) or a JSONL file of {"prompt": ...} lines (`benchmarks/package_prompts.py`;
`--fresh`: each request a prompt not used before, as the server bench's `--fresh-prompts`), closed-loop levels
of `--requests` requests, rounds interleaved between configurations.
Per configuration (plain, chain-3, adaptive, k0 = speculation on but never drafting, and chain-3 with
every step that admits or continues a prefill decoding plain, as adaptive does: `chain_pp`) the throughput, the
count and wall time of decode-only steps and of steps with a prefill, by the k each step ran, and the accepted
drafts per verify.

Every request decodes `--max-tokens` tokens, so a plain engine's requests finish together and its prefills
come in waves of C prompts; a speculative engine's drift apart, and it pays more, smaller prefill steps.
`--max-tokens-min N` draws each request's length uniformly from N..max-tokens (the same lengths for every
configuration), as requests of real workloads end at different lengths.
`--host` adds, per kind of step, the host time per step inside the engine's main functions (scheduling,
the runner's prepare and forward, graph replay and its input fill, sampling launch and resolve, the
draft's observe, prompt pass, follow and flush, the controller's choose and record_step), wrapped with a
timer (no profiler).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time

sys.path.insert(0, "benchmarks")
from default_pair import held_out_texts  # noqa: E402
from sweep import PROMPTS, configurations  # noqa: E402

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


HOST_FUNCTIONS = {  # label: (module, class or None, function)
    "schedule": ("specserve.engine.scheduler", "Scheduler", "schedule"),
    "prepare": ("specserve.engine.model_runner", "ModelRunner", "prepare"),
    "forward": ("specserve.engine.model_runner", "ModelRunner", "forward"),
    "graph replay": ("specserve.engine.cuda_graph", "GraphRunner", "replay"),
    "graph fill": ("specserve.layers.triton_ops", None, "fill_step"),
    "mixed fill": ("specserve.engine.cuda_graph", "GraphRunner", "fill_mixed"),
    "launch sampling": ("specserve.engine.engine", "LLMEngine", "_launch_sampling"),
    "resolve": ("specserve.engine.engine", "LLMEngine", "_resolve"),
    "wait for tokens": ("specserve.engine.engine", "InFlight", "host_tokens"),
    "draft observe": ("specserve.speculative.eagle3_proposer", "Eagle3Proposer", "observe"),
    "draft follow": ("specserve.speculative.eagle3_follow", "DraftFollower", "before_step"),
    "draft prompt pairs": ("specserve.speculative.eagle3_proposer", "Eagle3Proposer", "_store_prompt_pairs"),
    "draft flush": ("specserve.speculative.decoder", "SpecDecoder", "flush"),
    "choose": ("specserve.speculative.decoder", "SpecDecoder", "choose"),
    "record_step": ("specserve.speculative.decoder", "SpecDecoder", "record_step"),
}


class HostTimers:
    """Seconds spent inside each of HOST_FUNCTIONS (nested ones counted in both), accumulated since start."""

    def __init__(self):
        import importlib

        self.seconds: dict[str, float] = {}
        for label, (module, cls, name) in HOST_FUNCTIONS.items():
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            setattr(owner, name, self._timed(label, getattr(owner, name)))

    def _timed(self, label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
        return timed


def level(engine: LLMEngine, concurrency: int, total: int, lengths: list[int], prompts: Prompts,
          host: "HostTimers | None" = None) -> dict:
    issued = finished = tokens = 0
    split: dict[str, list] = {}  # "decode k0" / "prefill k3": [steps, seconds, {host function: seconds}]
    d0, a0 = engine.stats.spec.num_drafts, engine.stats.spec.num_accepted_tokens
    start = time.perf_counter()
    while finished < total:
        while issued < total and issued - finished < concurrency:
            params = SamplingParams(temperature=0, max_tokens=lengths[issued % len(lengths)], ignore_eos=True)
            engine.add_request(prompts.take(issued), params)
            issued += 1
        before = dict(host.seconds) if host else {}
        p0, t0 = engine.stats.num_prompt_tokens, time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - t0
        kind = "prefill" if engine.stats.num_prompt_tokens > p0 else "decode"
        cell = split.setdefault(f"{kind} k{engine.stats.spec.last_k}", [0, 0.0, {}])
        cell[0] += 1
        cell[1] += seconds
        for label, total_s in (host.seconds.items() if host else ()):
            cell[2][label] = cell[2].get(label, 0.0) + total_s - before.get(label, 0.0)
        for out in outs:
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
    seconds = time.perf_counter() - start
    drafts, accepted = engine.stats.spec.num_drafts - d0, engine.stats.spec.num_accepted_tokens - a0
    steps = {kind: {"steps": n, "seconds": round(t, 4), "ms_per_step": round(1e3 * t / n, 3),
                    **({"host_us_per_step": {k: round(1e6 * v / n, 1) for k, v in sorted(fns.items())}} if fns else {})}
             for kind, (n, t, fns) in sorted(split.items())}
    return {"output_throughput": tokens / seconds, "seconds": seconds,
            "decode_steps": sum(v["steps"] for k, v in steps.items() if k.startswith("decode")),
            "decode_s": sum(v["seconds"] for k, v in steps.items() if k.startswith("decode")),
            "prefill_steps": sum(v["steps"] for k, v in steps.items() if k.startswith("prefill")),
            "prefill_s": sum(v["seconds"] for k, v in steps.items() if k.startswith("prefill")),
            "steps": steps, "drafts": drafts, "accepted_per_draft": accepted / drafts if drafts else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--levels", default="5,10,30")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--max-tokens-min", type=int, default=None,
                    help="draw each request's length uniformly from this to --max-tokens (default: all --max-tokens)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="plain,chain,chain_pp,adaptive")
    ap.add_argument("--prompts", default="heldout", choices=("heldout", "builtin"))
    ap.add_argument("--dataset", default=None, help="a JSONL file of {\"prompt\": ...} lines (over --prompts)")
    ap.add_argument("--fresh", action="store_true", help="never hand out a prompt twice")
    ap.add_argument("--host", action="store_true", help="host time per step inside the engine's main functions")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    engines = {name: build(name, args.device, max(levels)) for name in args.configs.split(",")}
    tok = next(iter(engines.values())).tokenizer
    if args.dataset:
        texts = [json.loads(line)["prompt"] for line in open(args.dataset) if line.strip()]
        ids = [tok.encode(t) for t in texts]
    elif args.prompts == "builtin":
        ids = [tok.encode(t) for t in PROMPTS]
    else:
        ids = [tok.encode(text[:2000])[:128] for _, text in held_out_texts(sysconfig.get_paths()["stdlib"], 94)]
    prompts = {name: Prompts(ids, args.fresh) for name in engines}  # every configuration the same prompts
    warm = Prompts(ids[::-1], False)
    for engine in engines.values():
        level(engine, 2, 4, [16], warm)
    low = args.max_tokens if args.max_tokens_min is None else args.max_tokens_min
    rng = random.Random(0)
    lengths = [rng.randint(low, args.max_tokens) for _ in range(max(args.requests, max(levels)))]
    host = HostTimers() if args.host else None
    results: dict = {}
    for c in levels:
        for rnd in range(args.rounds):
            base = None
            for name, engine in engines.items():
                r = level(engine, c, max(args.requests, c), lengths, prompts[name], host)
                results.setdefault(name, {}).setdefault(c, []).append(r)
                base = base or r["output_throughput"]
                print(f"C={c} r{rnd} {name:12s} {r['output_throughput']:8.0f} tok/s "
                      f"({r['output_throughput'] / base:.2f}x)  decode steps {r['decode_steps']:4d} "
                      f"{r['decode_s'] * 1e3:7.1f} ms  prefill steps {r['prefill_steps']:3d} "
                      f"{r['prefill_s'] * 1e3:7.1f} ms  drafts {r['drafts']} accepted/draft "
                      f"{r['accepted_per_draft']:.2f}", flush=True)
                for kind, v in r["steps"].items():
                    fns = "  ".join(f"{k} {us:.0f}" for k, us in v.get("host_us_per_step", {}).items())
                    print(f"    {kind:11s} {v['steps']:5d} steps {v['ms_per_step']:7.2f} ms/step  {fns}", flush=True)
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
