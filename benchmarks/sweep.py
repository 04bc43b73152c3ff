"""In-process concurrency sweep: plain vs chain vs tree vs threshold vs adaptive, side by side.

    python benchmarks/sweep.py [--levels 1,2,5,10,30,70,100,250] [--requests 30] [--max-tokens 200] [--rounds 1]
                               [--prompts heldout|builtin] [--model PATH --draft PATH] [--device cpu|cuda]
                               [--out sweep.json] [--host-profile DIR]

`--temperature T [--top-p P] [--sampled-share S] [--seeded]` makes the requests (or a share S of them, spread
evenly) sample (with `--seeded`, request i with seed i); greedy otherwise.

Prompts: `heldout` (default), the opening 128 tokens of each Python standard-library file the shipped
target was not trained on (its corpus.json lists them; the shipped pair's natural workload, as in
`default_pair.py`); `builtin`, eight short code headers, which end at a newline, a token boundary the
pair's tokenizer rarely makes there, so drafts accept less.

`--configs` picks among plain, chain, tree, threshold, adaptive, ngram and ngram-adaptive (prompt lookup,
chains of up to 4: always, or the adaptive policy's choice; with finished requests' history), ngram-own and
ngram-own-adaptive (the same without the history), ngram-tree and ngram-tree-adaptive (prompt-lookup trees of
8 tokens, depth 4, two children a node, beside chains of up to 4 for the adaptive policy), k0 (speculation on
but never drafting: what a plain step of a speculative engine costs), plain-b (a second plain engine: how far
apart two identical configurations measure on this machine, the noise floor of every ratio) and, to see what
the overlap scheduler buys, plain-sync and adaptive-sync (the same with `disable_overlap_schedule`), and to
see what mixed CUDA graphs buy, plain-eager-prompts and adaptive-eager-prompts (`cuda_graph_max_tokens=0`).
`--host-profile DIR` runs each configuration's first round of each level under cProfile and writes its top
host functions to DIR/CONFIG-cLEVEL.txt (the level's timing then includes the profiler's overhead).

For each level C, each configuration keeps C requests in flight (closed loop) until `max(requests, C)`
have finished, all configurations receiving the same prompts. Levels run configurations in turn, so
machine noise hits them alike. Reports output tokens/s per level and the ratio to plain, and for the
adaptive policy the mean k it chose; the JSON also keeps, per level, the adaptive controller's
explanation (start-up step costs, chosen k and predicted goodput per batch bucket, exploration shares).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sysconfig
import time

from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams

PROMPTS = [
    "def read_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n", "def parse_args(argv=None):\n    parser = argparse.",
    "    def __repr__(self):\n", "def _check_type(value, expected):\n    \"\"\"Raise TypeError unless",
    "class Error(Exception):\n    \"\"\"Base class for", "def walk(top, topdown=True, onerror=None):\n",
]

NGRAM_TREE = dict(speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_eagle_topk=2,
                  speculative_num_draft_tokens=8)


def configurations(draft: str, threshold: int = 8) -> dict[str, dict]:
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft)
    return {
        "plain": dict(speculative_algorithm="none"),
        "plain-b": dict(speculative_algorithm="none"),  # a second plain engine: the noise floor of the ratios
        "chain": dict(spec, speculative_num_steps=3, speculative_policy="always"),
        "chain1": dict(spec, speculative_num_steps=1, speculative_policy="always"),
        "chain2": dict(spec, speculative_num_steps=2, speculative_policy="always"),
        "tree": dict(spec, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                     speculative_policy="always"),
        "threshold": dict(spec, speculative_num_steps=3, speculative_policy="threshold",
                          speculative_disable_batch_threshold=threshold),
        "adaptive": dict(spec, speculative_num_steps=3, speculative_policy="adaptive"),
        "adaptive-tree": dict(spec, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8,
                              speculative_policy="adaptive"),  # plain, chains of 1-5 and the tree
        "k0": dict(spec, speculative_num_steps=3, speculative_policy="threshold",  # never drafts
                   speculative_disable_batch_threshold=0),
        "plain-eager-prompts": dict(speculative_algorithm="none", cuda_graph_max_tokens=0),  # no mixed graphs
        "adaptive-eager-prompts": dict(spec, speculative_num_steps=3, speculative_policy="adaptive",
                                       cuda_graph_max_tokens=0),
        "ngram": dict(speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_policy="always"),
        "ngram-adaptive": dict(speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_policy="adaptive"),
        "ngram-own": dict(speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_policy="always",
                          speculative_ngram_capacity=0),
        "ngram-own-adaptive": dict(speculative_algorithm="NGRAM", speculative_num_steps=4,
                                   speculative_policy="adaptive", speculative_ngram_capacity=0),
        "ngram-tree": dict(NGRAM_TREE, speculative_policy="always"),
        "ngram-tree-adaptive": dict(NGRAM_TREE, speculative_policy="adaptive"),
        "plain-sync": dict(speculative_algorithm="none", disable_overlap_schedule=True),
        "adaptive-sync": dict(spec, speculative_num_steps=3, speculative_policy="adaptive",
                              disable_overlap_schedule=True),
    }


def request_params(max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, share: float = 1.0,
                   seeded: bool = False):
    """Request i's sampling parameters: greedy, or at `temperature` / `top_p` for a `share` of the requests
    spread evenly (request i samples when floor((i + 1) * share) > floor(i * share)), the rest greedy; seeded:
    a sampling request i has seed i."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True)
    if temperature == 0:
        return lambda i: greedy

    def params(i: int) -> SamplingParams:
        if int((i + 1) * share) == int(i * share):
            return greedy
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True,
                              seed=i) if seeded else sampled

    return params


def sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled requests' temperature (0: all greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--sampled-share", type=float, default=1.0,
                    help="with --temperature: the share of requests that sample, spread evenly; the rest greedy")
    ap.add_argument("--seeded", action="store_true", help="with --temperature: sampling request i has seed i")


def run_level(engine: LLMEngine, concurrency: int, total: int, max_tokens: int, prompts: list = PROMPTS,
              params_for=None) -> dict:
    params_for = params_for or request_params(max_tokens)
    issued = finished = tokens = 0
    spec = engine.stats.spec
    drafts, accepted = spec.num_drafts, spec.num_accepted_tokens
    ks, start = [], time.perf_counter()
    while finished < total:
        while issued < total and issued - finished < concurrency:
            engine.add_request(prompts[issued % len(prompts)], params_for(issued))
            issued += 1
        for out in engine.step():
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
        ks.append(engine.stats.spec.last_k)
    seconds = time.perf_counter() - start
    drafts = spec.num_drafts - drafts
    return {"output_throughput": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "mean_k": sum(ks) / len(ks),  # draft tokens per request a step, plain steps counted as 0
            "accept_length": 1 + (spec.num_accepted_tokens - accepted) / drafts if drafts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,2,5,10,30,70,100,250")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--model", default=SHIPPED_TARGET)
    ap.add_argument("--draft", default=SHIPPED_DRAFT)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="plain,chain,tree,threshold,adaptive")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved repeats of each level; the median throughput is reported")
    ap.add_argument("--prompts", default="heldout", choices=("heldout", "builtin"))
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="where the held-out files are")
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-profile", default="", help="folder for cProfile tables of each first round")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="each level and round its own prompts (the same for every configuration), none seen before: "
                         "for methods that learn across requests (NGRAM's history), which repeats would flatter")
    sampling_args(ap)
    args = ap.parse_args()
    params_for = request_params(args.max_tokens, args.temperature, args.top_p, args.sampled_share, args.seeded)
    levels = [int(x) for x in args.levels.split(",")]
    configs = {k: v for k, v in configurations(args.draft).items() if k in args.configs.split(",")}
    engines = {name: LLMEngine(EngineConfig.from_options(model=args.model, device=args.device,
                                                         max_num_seqs=max(levels), **opts))
               for name, opts in configs.items()}
    prompts = PROMPTS
    if args.prompts == "heldout":
        from default_pair import held_out_texts  # benchmarks/ is on sys.path when run as a script

        tokenizer = next(iter(engines.values())).tokenizer
        prompts = [tokenizer.encode(text[:2000])[:128] for _, text in held_out_texts(args.stdlib, 94)]
        if not prompts:
            raise SystemExit(f"no held-out files under {args.stdlib}: pass --stdlib or --prompts builtin")
    for name, engine in engines.items():
        graphs = engine.runner.graphs
        if graphs is not None:
            print(f"{name}: {len(graphs.graphs)} CUDA graphs captured in {graphs.capture_seconds:.1f} s, "
                  f"{graphs.capture_bytes / 2**20:.0f} MiB", flush=True)
    warmup, prompts = prompts[-4:], prompts[:-4] if args.fresh_prompts else prompts
    need = sum(max(args.requests, c) for c in levels) * args.rounds
    if args.fresh_prompts and need > len(prompts):
        raise SystemExit(f"--fresh-prompts needs {need} prompts, and there are {len(prompts)}: fewer requests, levels "
                         f"or rounds")
    for engine in engines.values():  # warm-up
        run_level(engine, 2, 4, 16, warmup)
    results: dict = {name: {} for name in engines}
    used = 0
    for c in levels:
        runs: dict = {name: [] for name in engines}
        for r in range(args.rounds):  # interleaved, so the machine's noise hits every configuration alike
            level_prompts = prompts
            if args.fresh_prompts:
                level_prompts, used = prompts[used:used + max(args.requests, c)], used + max(args.requests, c)
            for name, engine in engines.items():
                host = cProfile.Profile() if args.host_profile and r == 0 else None
                if host:
                    host.enable()
                runs[name].append(run_level(engine, c, max(args.requests, c), args.max_tokens, level_prompts,
                                            params_for))
                if host:
                    host.disable()
                    os.makedirs(args.host_profile, exist_ok=True)
                    with open(os.path.join(args.host_profile, f"{name}-c{c}.txt"), "w") as f:
                        stats = pstats.Stats(host, stream=f)
                        stats.sort_stats("cumulative").print_stats(45)
                        stats.sort_stats("tottime").print_stats(30)
        for name, rs in runs.items():
            results[name][c] = dict(sorted(rs, key=lambda r: r["output_throughput"])[len(rs) // 2],
                                    rounds=[round(r["output_throughput"], 1) for r in rs])
        tput = {n: results[n][c]["output_throughput"] for n in engines}
        row = "  ".join(f"{n} {tput[n]:7.1f}" + (f" ({tput[n] / tput['plain']:.2f}x)" if "plain" in tput else "")
                        for n in engines)
        for name, engine in engines.items():  # why the adaptive policy chose as it did (Controller.explain)
            if engine.spec is not None and engine.spec.controller.policy == "adaptive":
                results[name][c]["controller"] = engine.spec.controller.explain()
        mean_k = results.get("adaptive", {}).get(c, {}).get("mean_k", 0)
        print(f"C={c:<4} {row}  adaptive mean k {mean_k:.2f}", flush=True)
        if args.out:  # after every level, so a run cut short keeps what it measured
            json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
