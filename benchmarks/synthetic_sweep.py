"""The concurrency sweep at a realistic model size: the Llama-3.1-8B shape with dummy weights, drafts
accepted at synthetic rates (`speculative_synthetic_acceptance_rates`; random weights accept nothing).

    python benchmarks/synthetic_sweep.py --out sweep_8b.json [--plot sweep_8b.png]
        [--levels 1,2,5,10,30,70,100,250] [--requests 30] [--max-tokens 200] [--warmup 5]
        [--configs plain,chain,tree,threshold,adaptive] [--profiles shipped,weak,strong]
    python benchmarks/synthetic_sweep.py --plot sweep_8b.png --merge part1.json part2.json --out all.json

For each configuration (plain, a chain of 3 speculating every step, the default tree speculating every
step, the threshold policy at SGLang's batch threshold, the adaptive controller over plain and chains of
1-3, and over plain, chains of 1-5 and the tree: `adaptive-tree`) and each acceptance
profile, one engine keeps C requests in flight (closed loop) until max(requests, C) have finished, at
every level C; output tokens/s per level. The prefix cache is off unless `--prefix-caching`: the levels
reuse one prompt list, so with it on, later levels and profiles would skip prefills earlier ones paid.
Prompts are random token ids of log-uniform length between --prompt-len-min and --prompt-len-max
(default 256-2048, median ~720: coding and agent prompts), the same for every configuration; 200
greedy tokens each (`--temperature` as in sweep.py: sampled), EOS ignored. `--requests` may be one number
or one per level. One engine at a time (an 8B engine holds ~16 GB of weights and its graphs), built once
per configuration; the profiles run on it in turn, the controller's learned acceptance reset between them
and `--warmup` requests run first.

Profiles (entry i: probability that the first i+1 drafts are accepted):
- shipped: the shipped pair's measured rates (README: chain 0.77 0.61 0.53; tree 0.88 0.70 0.54 0.43 0.33);
- weak: chain 0.4 0.2 0.1; strong: chain 0.9 0.8 0.7. Their tree rates (five positions) are assumptions,
  continuing the chain's last conditional rate and, as the shipped pair's tree does over its chain,
  accepting the first draft more often: weak 0.5 0.25 0.12 0.06 0.03, strong 0.95 0.88 0.8 0.72 0.64.
A tree configuration's chain candidates (`adaptive-tree`: the adaptive policy choosing among plain, chains
of 1-5 and the tree) accept at the profile's chain rates, continued to five drafts the same way
(`speculative_synthetic_chain_rates`), not at the tree's.

Per level the JSON keeps output tokens/s, per-request tokens/s spread, mean k, decode steps and the mean
wall time of a step, the measured acceptance length, the engine's draft / verify seconds, and the wall time
of `engine.step` split by whether the step computed prompt tokens and by its k (`time_split`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

from sweep import configurations as sweep_configurations  # benchmarks/ is on sys.path when run as a script
from sweep import request_params, sampling_args

PROFILES = {
    "shipped": {"chain": (0.77, 0.61, 0.53), "tree": (0.88, 0.70, 0.54, 0.43, 0.33)},
    "weak": {"chain": (0.4, 0.2, 0.1), "tree": (0.5, 0.25, 0.12, 0.06, 0.03)},
    "strong": {"chain": (0.9, 0.8, 0.7), "tree": (0.95, 0.88, 0.8, 0.72, 0.64)},
}
HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "configs", "llama-3.1-8b")
DRAFT = os.path.join(HERE, "configs", "llama-3.1-8b-eagle3")


def configurations(draft: str) -> dict[str, dict]:
    """sweep.py's configurations, the threshold at SGLang's 32, without the overlap-off variants."""
    return {k: v for k, v in sweep_configurations(draft, threshold=32).items() if not k.endswith("-sync")}


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    return [[rng.randrange(1000, vocab) for _ in range(length)] for length in lengths]


def run_level(engine, concurrency: int, total: int, max_tokens: int, prompt_ids: list, params_for=None) -> dict:
    """Closed loop: `concurrency` requests in flight until `total` finished; what the level measured.
    params_for(i): request i's sampling parameters (sweep.request_params; default greedy)."""
    params_for = params_for or request_params(max_tokens)
    stats, spec = engine.stats, engine.stats.spec
    before = (stats.num_steps, spec.num_drafts, spec.num_accepted_tokens, spec.draft_time_s, spec.verify_time_s)
    issued = finished = tokens = 0
    ks, started, rates = [], {}, []
    split: dict[str, list] = {}  # "prompt k2" / "decode k0"...: [steps, seconds] of engine.step by kind and k
    start = time.perf_counter()
    while finished < total:
        while issued < total and issued - finished < concurrency:
            seq = engine.add_request(prompt_ids[issued % len(prompt_ids)], params_for(issued))
            started[seq.request_id] = time.perf_counter()
            issued += 1
        t0, prompted = time.perf_counter(), stats.num_prompt_tokens
        for out in engine.step():
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
                rates.append(len(out.token_ids) / (time.perf_counter() - started.pop(out.request_id)))
        ks.append(spec.last_k)
        kind = "prompt" if stats.num_prompt_tokens > prompted else "decode"
        cell = split.setdefault(f"{kind} k{spec.last_k}", [0, 0.0])
        cell[0] += 1
        cell[1] += time.perf_counter() - t0
    seconds = time.perf_counter() - start
    steps, drafts, accepted, draft_s, verify_s = (
        now - then for now, then in zip(
            (stats.num_steps, spec.num_drafts, spec.num_accepted_tokens, spec.draft_time_s, spec.verify_time_s),
            before))
    rates.sort()
    return {"output_throughput": tokens / seconds, "seconds": seconds, "tokens": tokens, "requests": total,
            "mean_k": sum(ks) / len(ks), "steps": steps, "mean_step_ms": 1e3 * seconds / max(steps, 1),
            "accept_length": 1 + accepted / drafts if drafts else None, "draft_s": draft_s, "verify_s": verify_s,
            "request_tok_s": {"min": rates[0], "median": rates[len(rates) // 2], "max": rates[-1]},
            "time_split": {k: {"steps": n, "seconds": round(t, 4)} for k, (n, t) in sorted(split.items())}}


def extended(rates: tuple[float, ...], depth: int) -> tuple[float, ...]:
    """A profile's chain rates to `depth` drafts, continuing the last conditional rate."""
    cond = rates[-1] / rates[-2] if len(rates) > 1 and rates[-2] > 0 else rates[-1]
    out = list(rates[:depth])
    while len(out) < depth:
        out.append(round(out[-1] * cond, 4))
    return tuple(out)


def profile_rates(profile: str, options: dict) -> dict:
    """The synthetic-acceptance options of a configuration under a profile: a tree's rates, and for its
    chain candidates (the adaptive policy's) the profile's chain rates to the tree's depth."""
    if options.get("speculative_eagle_topk", 1) == 1:
        return {"speculative_synthetic_acceptance_rates": extended(PROFILES[profile]["chain"],
                                                                  options.get("speculative_num_steps", 3))}
    return {"speculative_synthetic_acceptance_rates": PROFILES[profile]["tree"],
            "speculative_synthetic_chain_rates": extended(PROFILES[profile]["chain"], options["speculative_num_steps"])}


def set_profile(engine, rates: dict) -> None:
    """Switch the engine's synthetic acceptance and make its controller learn acceptance afresh."""
    synthetic = engine.spec.synthetic
    synthetic.rates = rates["speculative_synthetic_acceptance_rates"]
    synthetic.chain_rates = rates.get("speculative_synthetic_chain_rates", synthetic.rates)
    engine.spec.controller.forget_acceptance()


def sweep(args) -> dict:
    import torch

    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    levels = [int(x) for x in args.levels.split(",")]
    per_level = [int(x) for x in args.requests.split(",")]
    requests = per_level * len(levels) if len(per_level) == 1 else per_level
    if len(requests) != len(levels):
        raise SystemExit("--requests takes one number or one per level")
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    prompt_ids = prompts(max(max(requests), max(levels)), args.prompt_len_min, args.prompt_len_max, vocab)
    results = json.load(open(args.out)) if args.resume and os.path.exists(args.out) else {}
    configs = configurations(args.draft)
    params_for = request_params(args.max_tokens, args.temperature, args.top_p, args.sampled_share, args.seeded)
    for name in args.configs.split(","):
        shape = "tree" if configs[name].get("speculative_eagle_topk", 1) > 1 else "chain"
        plain = name.startswith("plain")
        synthetic = {} if plain else profile_rates("shipped", configs[name])
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig.from_options(
            model=args.model, load_format="dummy", device=args.device, max_num_seqs=max(levels),
            max_model_len=args.prompt_len_max + args.max_tokens + 16, kv_cache_gb=args.kv_cache_gb,
            kv_host_ratio=0.0, enable_prefix_caching=args.prefix_caching, **configs[name], **synthetic))
        startup = time.perf_counter() - t0
        runs = [(p, n) for p in (["none"] if plain else args.profiles.split(","))
                for n in range(1, args.passes + 1)]
        for profile, n in runs:
            key = f"{name}/{profile}" + (f"@pass{n}" if n > 1 else "")
            if profile != "none":
                set_profile(engine, profile_rates(profile, configs[name]))
            run_level(engine, args.warmup, args.warmup, args.max_tokens, prompt_ids[::-1], params_for)
            results[key] = {"startup_s": startup, "rates": PROFILES.get(profile, {}).get(shape), "levels": {}}
            for c, n in zip(levels, requests):
                r = run_level(engine, c, max(n, c), args.max_tokens, prompt_ids, params_for)
                if engine.spec is not None and engine.spec.controller.policy == "adaptive":
                    r["controller"] = engine.spec.controller.explain()  # why it chose as it did
                    r["step_times"] = step_times(engine.spec.controller)
                results[key]["levels"][str(c)] = r
                print(f"{key:20s} C={c:<4} {r['output_throughput']:9.1f} tok/s  k {r['mean_k']:.2f}  "
                      f"step {r['mean_step_ms']:6.2f} ms  tau {r['accept_length'] or 0:.2f}", flush=True)
                json.dump(results, open(args.out, "w"), indent=1)  # after every level: a cut run keeps its data
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def step_times(controller) -> dict:
    """Per bucket and shape, the (batch size, ms) samples its step times hold (at the speed index 1)."""
    out: dict = {}
    for (b, shape), times in sorted(controller.step_time.items(), key=lambda kv: (kv[0][0], kv[0][1].num_nodes)):
        out.setdefault(str(b), {})[shape.label] = [(n, round(t * 1e3, 3)) for n, t in times.samples]
    return out


def table(results: dict) -> str:
    """Markdown: output tokens/s per level and configuration, and each one's ratio to plain."""
    keys = list(results)
    levels = list(next(iter(results.values()))["levels"])
    plain = results.get("plain/none", {}).get("levels", {})
    lines = ["| C | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for c in levels:
        cells = []
        for k in keys:
            r = results[k]["levels"].get(c)
            if r is None:
                cells.append("")
            elif k == "plain/none" or c not in plain:
                cells.append(f"{r['output_throughput']:,.0f}")
            else:
                cells.append(f"{r['output_throughput'] / plain[c]['output_throughput']:.2f}x")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def against_best(results: dict) -> str:
    """Markdown: per profile, each adaptive configuration's output tokens/s over the best fixed one's (plain
    and the non-adaptive configurations of that profile) at every level, and how many levels reach 0.95."""
    lines = []
    for key in (k for k in results if k.split("/")[0].startswith("adaptive")):
        profile = key.split("/")[1]
        fixed = [k for k in results if k == "plain/none" or (k.split("/")[1] == profile
                                                             and not k.split("/")[0].startswith(("adaptive", "plain")))]
        ratios = []
        for c, r in results[key]["levels"].items():
            rivals = [results[k]["levels"][c]["output_throughput"] for k in fixed if c in results[k]["levels"]]
            if rivals:
                ratios.append((c, r["output_throughput"] / max(rivals)))
        met = sum(x >= 0.95 for _, x in ratios)
        lines.append(f"| {key} | " + " / ".join(f"{x:.2f}" for _, x in ratios) + f" | {met} of {len(ratios)} |")
    if not lines:
        return ""
    return "\n".join(["| adaptive / best fixed, by level | ratios | >= 0.95 |", "|---|---|---|", *lines])


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = sorted({k.split("/")[1] for k in results if not k.startswith("plain/")})
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), sharey=True, squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        for key, res in results.items():
            if key.split("/")[1] == profile or key.startswith("plain/"):
                levels = [int(c) for c in res["levels"]]
                ax.plot(levels, [r["output_throughput"] for r in res["levels"].values()], marker="o",
                        label=key.split("/")[0] + key.partition("@")[1] + key.partition("@")[2],
                        linestyle="--" if key.startswith("plain/") else "-")
        ax.set_xscale("log")
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_title(f"acceptance: {profile}")
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].legend()
    fig.suptitle("Llama-3.1-8B shape, dummy weights, synthetic acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,2,5,10,30,70,100,250")
    ap.add_argument("--requests", default="30", help="requests per level: one number, or one per level")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5, help="requests run before each configuration and profile")
    ap.add_argument("--prompt-len-min", type=int, default=256)
    ap.add_argument("--prompt-len-max", type=int, default=2048)
    ap.add_argument("--configs", default="plain,chain,tree,threshold,adaptive")
    ap.add_argument("--profiles", default="shipped,weak,strong")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=TARGET, help="target config folder (dummy weights)")
    ap.add_argument("--draft", default=DRAFT, help="EAGLE-3 draft config folder (dummy weights)")
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="keep the engine's prefix cache on: levels and profiles after the first then skip the "
                         "prefill of prompts they share with earlier ones (off: every request prefills)")
    ap.add_argument("--passes", type=int, default=1, help="run each configuration's levels this many times")
    ap.add_argument("--resume", action="store_true", help="add to --out instead of starting it afresh")
    ap.add_argument("--merge", nargs="+", help="no run: merge these result files into --out")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot")
    sampling_args(ap)
    args = ap.parse_args()
    if args.merge:
        results = {}
        for path in args.merge:  # a configuration in several files: its levels are merged
            for name, run in json.load(open(path)).items():
                if name in results:
                    run = dict(run, levels={**results[name]["levels"], **run["levels"]})
                results[name] = run
        json.dump(results, open(args.out, "w"), indent=1)
    else:
        results = sweep(args)
    print(table(results))
    print(against_best(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
