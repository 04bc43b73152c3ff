"""Where a speculative step's time goes on a GPU: plain decoding against speculating every step.

    python benchmarks/spec_step.py --model 8b|tiny [--configs plain,chain,tree] [--batches 1,8,64] --out step.json
        [--host-profile DIR]

Per configuration and batch size, after a warm-up pass over every batch size: wall ms per decode step,
output tokens per request per step, the engine's draft and verify time per step, and the device-kernel
ms per step from the torch profiler (on CUDA, a profiled window in a second pass over the configurations, after
every wall time: a profiler session slows the process's later graph replays) with its 30 costliest kernels
(`kernels`: launches and us per step). `8b`: the Llama-3.1-8B shape and its
EAGLE-3 drafter shape with dummy bf16 weights (the drafts accept nothing, so steps stay at the full
shape); `tiny`: the shipped pair. Prompts are 200 random token ids. The ratio of a speculative step's
wall time to its kernel time is the host's share; the ratio to a plain step is what the controller weighs
against the tokens a verify gains.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def configurations(which: str) -> tuple[dict, dict]:
    """(engine options common to every configuration, per-configuration options)."""
    spec = dict(speculative_algorithm="EAGLE3", speculative_policy="always")
    if which == "8b":
        common = dict(model=os.path.join(HERE, "configs", "llama-3.1-8b"), load_format="dummy")
        spec["speculative_draft_model_path"] = os.path.join(HERE, "configs", "llama-3.1-8b-eagle3")
    else:
        from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET

        common = dict(model=SHIPPED_TARGET)
        spec["speculative_draft_model_path"] = SHIPPED_DRAFT
    return common, {
        "plain": dict(speculative_algorithm="none"),
        "chain": dict(spec, speculative_num_steps=3),
        "tree": dict(spec, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
    }


def measure(engine, batch: int, steps: int, profiled: bool, seed: int, host_profile: str = "") -> dict:
    """Start `batch` requests, finish their prefills, then time `steps` decode steps (host_profile: also
    write the top host functions of those steps, by own time, to this file)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from specserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=steps * 8 + 64, ignore_eos=True)
    vocab = engine.arch.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(10, vocab, (200,), generator=gen).tolist(), params)
    running = engine.scheduler.running
    while len(running) < batch or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
        engine.step()
    for _ in range(4):
        engine.step()
    spec, stats = engine.stats.spec, engine.stats
    before = (spec.draft_time_s, spec.verify_time_s, stats.num_generation_tokens)
    kernel_ms, kernel_table = None, None
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    start = time.perf_counter()
    if profiled and torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if (getattr(e, "self_device_time_total", 0) or 0) > 0]
        kernel_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:30]
        kernel_table = [{"name": e.key[:120], "per_step": round(e.count / steps, 2),
                         "us_per_step": round(e.self_device_time_total / steps, 2)} for e in top]
    else:
        host = cProfile.Profile() if host_profile else None
        if host:
            host.enable()
        for _ in range(steps):
            engine.step()
        sync()
        if host:
            host.disable()
            with open(host_profile, "w") as f:
                pstats.Stats(host, stream=f).sort_stats("tottime").print_stats(40)
    wall = time.perf_counter() - start
    for seq in list(engine.requests.values()):
        engine.abort(seq.request_id)
    while engine.has_unfinished():
        engine.step()
    return {"ms_per_step": 1e3 * wall / steps,
            "tokens_per_request_step": (stats.num_generation_tokens - before[2]) / steps / batch,
            "draft_ms": 1e3 * (spec.draft_time_s - before[0]) / steps,
            "verify_ms": 1e3 * (spec.verify_time_s - before[1]) / steps, "kernel_ms": kernel_ms,
            "kernels": kernel_table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("8b", "tiny"), default="8b")
    ap.add_argument("--configs", default="plain,chain,tree")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test, no kernel times)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--host-profile", default="", help="folder: write each configuration and batch's top host "
                    "functions (cProfile of a separate window of steps) there")
    args = ap.parse_args()
    import torch

    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    common, configs = configurations(args.model)
    names = args.configs.split(",")
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}

    def build(name: str) -> LLMEngine:
        """The configuration's engine, warmed up: every shape's kernels compiled before anything is timed."""
        engine = LLMEngine(EngineConfig.from_options(device=args.device, max_model_len=1024, max_num_seqs=max(batches),
                                                     kv_cache_gb=16, kv_host_ratio=0.0, **common, **configs[name]))
        for batch in batches:
            measure(engine, batch, 4, False, seed=0)
        return engine

    def release(engine: LLMEngine) -> None:
        engine.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # every wall time first: after a torch profiler session, CUDA graph replays in the process run 2-5% slower
    # (docs/performance.md, session 37), so the profiled windows come in a second pass over the configurations
    for name in names:
        engine = build(name)
        for batch in batches:
            results[f"{args.model}/{name}/bs{batch}"] = measure(engine, batch, args.steps, False, seed=batch)
            if args.host_profile:
                os.makedirs(args.host_profile, exist_ok=True)
                measure(engine, batch, args.steps, False, batch + 2,
                        os.path.join(args.host_profile, f"{args.model}-{name}-bs{batch}.txt"))
            json.dump(results, open(args.out, "w"), indent=1)
        release(engine)
        del engine
    for name in names if torch.cuda.is_available() and args.device != "cpu" else []:
        engine = build(name)
        for batch in batches:
            profiled = measure(engine, batch, args.steps // 2, True, seed=batch + 1)
            results[f"{args.model}/{name}/bs{batch}"].update(kernel_ms=profiled["kernel_ms"] or 0.0,
                                                            kernels=profiled["kernels"],
                                                            profiled_ms_per_step=profiled["ms_per_step"])
            json.dump(results, open(args.out, "w"), indent=1)
        release(engine)
        del engine
    for name in names:
        for batch in batches:
            row = results[f"{args.model}/{name}/bs{batch}"]
            print(f"{args.model:5s} {name:6s} bs {batch:3d}  wall {row['ms_per_step']:6.2f} ms  kernels "
                  f"{row['kernel_ms'] or 0.0:6.2f} ms  draft {row['draft_ms']:5.2f}  "
                  f"verify {row['verify_ms']:5.2f}  tok/req/step {row['tokens_per_request_step']:.2f}", flush=True)


if __name__ == "__main__":
    main()
