"""One rank against several: decode tokens/s per batch size, the share of each step spent in collectives,
and the k the adaptive controller chooses per batch size, for tensor_parallel_size 1 and N side by side.

    python benchmarks/tensor_parallel.py --threads 1                       # the shipped pair on this CPU
    python benchmarks/tensor_parallel.py --device cuda --load-format dummy \\
        --model benchmarks/configs/llama-3.1-8b --draft benchmarks/configs/llama-3.1-8b-eagle3 \\
        --batch 1,8,64 --acceptance 0.77,0.61,0.53 --out tp.json           # the Llama-3.1-8B shape

Configurations: plain (no drafter), chain (speculate every step) and adaptive (the default policy).
Only steps in which every request decodes count (prefill excluded). Collective time: on CUDA, the device
time of NCCL kernels in a profiled window of steps (they include waiting for the other rank), per step,
over the unprofiled step time, profiled on a fresh engine after every timed run (a profiler session slows
the process's later graph replays); on CPU, rank 0's wall time inside all-reduce / all-gather / sending the
step's call. `--acceptance` pins the controller's per-position acceptance (dummy weights accept nothing,
so the choice would be k = 0 whatever the costs): the k it then picks shows what the measured step costs
of one rank against N decide, for a drafter that accepts that often. Writes every figure to `--out`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch
from prefix_cache import timed  # benchmarks/ is on sys.path when run as a script

from specserve import LLM, SamplingParams
from specserve.engine.distributed import Ranks
from specserve.layers.parallel import TensorParallel

PROMPTS = ["def read_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n", "    def __repr__(self):\n"]
CONFIGURATIONS = {
    "plain": dict(speculative_algorithm="none"),
    "chain": dict(speculative_policy="always"),
    "adaptive": dict(speculative_policy="adaptive"),
}
waited_s: dict[str, float] = {}  # per timed call name: rank 0's wall time inside it


def prompts(batch: int, args, vocab: int, gen: torch.Generator) -> list:
    if args.load_format == "dummy":
        return [torch.randint(10, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
    return [PROMPTS[i % len(PROMPTS)] for i in range(batch)]


def start(engine, batch: int, args, gen) -> None:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts(batch, args, engine.arch.vocab_size, gen):
        engine.add_request(p, params)


def all_decoding(engine, batch: int) -> bool:
    running = engine.scheduler.running
    return len(running) == batch and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running)


def decode_steps(engine, batch: int, args, gen) -> dict:
    """Run `batch` requests to the end; time the steps in which all of them decode."""
    start(engine, batch, args, gen)
    stats = engine.stats
    seconds, tokens, steps, ks, waited = 0.0, 0, 0, Counter(), 0.0
    while engine.has_unfinished():
        decoding = all_decoding(engine, batch)
        before, host_before, t = stats.num_generation_tokens, sum(waited_s.values()), time.perf_counter()
        engine.step()
        if decoding and len(engine.scheduler.running) == batch:
            seconds += time.perf_counter() - t
            tokens += stats.num_generation_tokens - before
            waited += sum(waited_s.values()) - host_before
            steps += 1
            ks[stats.spec.last_k if engine.spec is not None else 0] += 1
    return dict(seconds=seconds, tokens=tokens, steps=steps, ks=ks, host_waited=waited)


def nccl_ms_per_step(engine, batch: int, args, gen, window: int = 16) -> float:
    """Device milliseconds of NCCL kernels per decode step, over a profiled window of decode steps (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    start(engine, batch, args, gen)
    while engine.has_unfinished() and not all_decoding(engine, batch):
        engine.step()
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while steps < window and all_decoding(engine, batch):
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    us = sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
             for e in prof.key_averages() if "nccl" in e.key.lower())
    return us / 1e3 / max(1, steps)


def build(tp: int, name: str, args) -> LLM:
    """The configuration's engine on tp ranks."""
    options = dict(CONFIGURATIONS[name])
    if name != "plain" and args.draft:
        options["speculative_draft_model_path"] = args.draft
    if name != "plain":
        options.setdefault("speculative_algorithm", "EAGLE3")
    return LLM(args.model, tensor_parallel_size=tp, device=args.device, load_format=args.load_format,
               max_model_len=args.prompt_len + args.max_tokens + 64, max_num_seqs=max(args.batches),
               kv_host_ratio=0.0, **options)


def collective_ms(tp: int, name: str, args) -> dict:
    """Per batch size, the device ms of NCCL kernels per decode step (`nccl_ms_per_step`) of a fresh engine."""
    llm = build(tp, name, args)
    try:
        gen = torch.Generator().manual_seed(0)
        return {batch: nccl_ms_per_step(llm.engine, batch, args, gen) for batch in args.batches}
    finally:
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()


def measure(tp: int, name: str, args) -> dict:
    llm = build(tp, name, args)
    engine = llm.engine
    rows = {}
    try:
        if engine.spec is not None and args.acceptance:
            rates = [float(x) for x in args.acceptance.split(",")]
            engine.spec.controller.pin_acceptance(rates)
        gen = torch.Generator().manual_seed(0)
        warm = dict(vars(args), max_tokens=8)
        for batch in args.batches:
            decode_steps(engine, batch, argparse.Namespace(**warm), gen)  # warm: compiles, controller samples
            r = min((decode_steps(engine, batch, args, gen) for _ in range(args.rounds)), key=lambda r: r["seconds"])
            ms = 1e3 * r["seconds"] / r["steps"]
            row = dict(tok_s=r["tokens"] / r["seconds"], ms_per_step=ms, decode_steps=r["steps"],
                       k_chosen={str(k): n for k, n in sorted(r["ks"].items())},
                       mean_k=sum(k * n for k, n in r["ks"].items()) / r["steps"])
            if tp > 1 and args.device != "cuda":
                row["collective_share"] = r["host_waited"] / r["seconds"]
            rows[batch] = row
        for batch, row in rows.items():
            share = f"{100 * row['collective_share']:.0f}%" if "collective_share" in row else "-"
            print(f"| {batch} | {name} | {tp} | {row['ms_per_step']:.2f} | {row['tok_s']:,.0f} | {share} | "
                  f"{row['mean_k']:.2f} | {row['k_chosen']} |", flush=True)
        graphs = engine.runner.graphs
        return dict(rows=rows, cuda_graphs=graphs is not None and len(graphs.graphs) > 0)
    finally:
        engine.close()
        del llm, engine
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens with dummy weights")
    parser.add_argument("--rounds", type=int, default=1, help="runs per point; the fastest counts")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None, help="target folder (default: the shipped target)")
    parser.add_argument("--draft", default=None, help="EAGLE-3 folder (default: the shipped drafter)")
    parser.add_argument("--load-format", default="safetensors", choices=("safetensors", "dummy"))
    parser.add_argument("--acceptance", default=None, help="pin per-position acceptance, e.g. 0.77,0.61,0.53")
    parser.add_argument("--configs", default="plain,chain,adaptive")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batch.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    for cls, name in ((TensorParallel, "all_reduce"), (TensorParallel, "all_gather"), (Ranks, "send")):
        timed(cls, name, waited_s)
    print("| batch | configuration | ranks | ms / step | output tok/s | step in collectives | mean k | k chosen "
          "(steps) |")
    print("|---|---|---|---|---|---|---|---|")
    results = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   args={k: v for k, v in vars(args).items() if k != "batches"}, runs={})
    for name in args.configs.split(","):
        for tp in (1, args.tp):
            results["runs"][f"{name}/tp{tp}"] = measure(tp, name, args)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    # after every timed run: a profiler session slows the process's later graph replays (session 37)
    for name in args.configs.split(",") if args.tp > 1 and args.device == "cuda" else ():
        rows = results["runs"][f"{name}/tp{args.tp}"]["rows"]
        for batch, ms in collective_ms(args.tp, name, args).items():
            rows[batch].update(collective_ms_per_step=ms, collective_share=ms / rows[batch]["ms_per_step"])
            print(f"{name} TP={args.tp} batch {batch}: {ms:.2f} ms a step in NCCL kernels "
                  f"({100 * rows[batch]['collective_share']:.0f}%)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    for name in args.configs.split(","):
        one, many = results["runs"].get(f"{name}/tp1"), results["runs"].get(f"{name}/tp{args.tp}")
        ratios = [many["rows"][b]["tok_s"] / one["rows"][b]["tok_s"] for b in one["rows"]]
        print(f"{name}: TP={args.tp} / TP=1 tok/s per batch: " + ", ".join(f"{x:.2f}" for x in ratios)
              + f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
