"""Prefix caching on an agent workload: TTFT and throughput with caching off, device-only and device+host.

    python benchmarks/prefix_cache.py [--sessions 8] [--concurrency 2] [--turns 4] [--system-tokens 1024]
        [--message-tokens 64] [--max-tokens 32] [--rounds 1] [--device cpu|cuda] [--out prefix.json]

Agent sessions share a long system prompt (tool definitions) and resend their whole conversation every
turn: system + (tool result, reply) of every earlier turn + the new tool result. `concurrency` sessions
are in flight at a time (closed loop, sessions served round-robin, a session's next turn only after its
previous reply), so with more sessions than that, a session's context waits in the cache between turns.
TTFT is the time from adding a request to its first output token, queueing behind other requests'
steps included. Configurations (all greedy, same tokens, checked):

- off: no prefix caching;  device: prefix caching, a KV pool that holds everything (twice the working set);
- device_small: a device pool too small for the working set (shared prompt + every session's context);
- host_wt / host_wb: that small pool plus a host pool (write-through / write-back).

With --rounds R each configuration runs R times, configurations interleaved, the best TTFT row kept
per configuration (this is a shared, noisy machine; every round is in the JSON with the load average).
Host copy and draft flush times are wall time spent in those calls (on CUDA: issuing them, the copies
themselves run on a side stream). Prints a table and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 16


def source_text(n_chars: int, skip: int = 0) -> str:
    """Deterministic Python text from this repository's own sources."""
    folder = os.path.join(ROOT, "specserve")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.endswith(".py"))
    text = "".join(open(f).read() for f in files)
    return (text * (1 + (skip + n_chars) // len(text)))[skip:skip + n_chars]


def make_workload(tokenizer, args) -> tuple[list[int], list[list[list[int]]]]:
    """Token ids of the shared system prompt and of each session's per-turn tool results."""
    system = tokenizer.encode("# Tools\n" + source_text(args.system_tokens * 5))[:args.system_tokens]
    messages = []
    for s in range(args.sessions):
        turns = []
        for t in range(args.turns):
            ids = tokenizer.encode(f"\n# tool result {s}.{t}\n" + source_text(args.message_tokens * 5,
                                                                              skip=7919 * (1 + s * args.turns + t)))
            turns.append(ids[:args.message_tokens])
        messages.append(turns)
    return system, messages


def timed(obj, name: str, seconds: dict) -> None:
    """Accumulate the wall time of obj.name() calls into seconds[name] (on CUDA: time to issue them)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def run(engine: LLMEngine, system: list[int], messages, args) -> dict:
    """Serve every session's turns; returns TTFTs, throughput, outputs and cache statistics."""
    seconds: dict[str, float] = {}
    if engine.blocks.host is not None:
        timed(engine.blocks.host.pool, "save", seconds)
        timed(engine.blocks.host.pool, "load", seconds)
    if engine.spec is not None:
        timed(engine.spec.proposer, "flush", seconds)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    history = [list(system) for _ in messages]
    queue = [(s, t) for t in range(args.turns) for s in range(len(messages))]  # round-robin over sessions
    busy: dict[str, tuple[int, list[int], float]] = {}  # request id -> (session, prompt, time added)
    done = {s: -1 for s in range(len(messages))}  # last finished turn per session
    ttft, outputs, n_out = [], {}, 0
    start = time.perf_counter()
    while queue or busy:
        while queue and len(busy) < args.concurrency and done[queue[0][0]] == queue[0][1] - 1:
            s, t = queue.pop(0)
            prompt = history[s] + messages[s][t]
            seq = engine.add_request(prompt, params)
            busy[seq.request_id] = (s, prompt, time.perf_counter())
        for out in engine.step():
            s, prompt, added = busy[out.request_id]
            if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids):
                ttft.append(time.perf_counter() - added)
            if out.finished:
                del busy[out.request_id]
                history[s] = prompt + out.token_ids
                done[s] += 1
                outputs[(s, done[s])] = out.token_ids
                n_out += len(out.token_ids)
    elapsed = time.perf_counter() - start
    return {
        "mean_ttft_ms": 1000 * statistics.mean(ttft), "median_ttft_ms": 1000 * statistics.median(ttft),
        "p90_ttft_ms": 1000 * statistics.quantiles(ttft, n=10)[-1], "output_throughput": n_out / elapsed,
        "seconds": elapsed, "requests": len(ttft), "host_save_ms": 1000 * seconds.get("save", 0.0),
        "host_load_ms": 1000 * seconds.get("load", 0.0), "draft_flush_ms": 1000 * seconds.get("flush", 0.0),
        "outputs": [outputs[k] for k in sorted(outputs)],
    }


def configurations(args, pool_small: int, pool_ample: int) -> dict[str, dict]:
    small = dict(num_kv_blocks=pool_small)
    host = dict(small, kv_host_ratio=args.host_ratio)
    no_host = dict(kv_host_ratio=0.0)  # the host tier is on by default on CUDA
    return {
        "off": dict(no_host, enable_prefix_caching=False, num_kv_blocks=pool_ample),
        "device": dict(no_host, num_kv_blocks=pool_ample),
        "device_small": dict(no_host, **small),
        "host_wt": dict(host, kv_host_policy="write_through"),
        "host_wb": dict(host, kv_host_policy="write_back"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--message-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--small-pool-blocks", type=int, default=None,
                    help="device pool of the *_small / host configurations (default: half the working set)")
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--configs", default="off,device,device_small,host_wt,host_wb")
    ap.add_argument("--model", default=SHIPPED_TARGET)
    ap.add_argument("--draft", default=SHIPPED_DRAFT)
    ap.add_argument("--speculative-algorithm", default="EAGLE3", choices=("EAGLE3", "none"))
    ap.add_argument("--speculative-policy", default="adaptive", choices=("adaptive", "always", "threshold"))
    ap.add_argument("--speculative-disable-batch-threshold", type=int, default=32,
                    help="threshold policy: plain decoding while more requests run (0: always plain)")
    ap.add_argument("--load-format", default="safetensors", choices=("safetensors", "dummy"),
                    help="dummy: random weights of the model folder's shape (timing only)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    longest = args.system_tokens + args.turns * (args.message_tokens + args.max_tokens)
    private = -(-(longest - args.system_tokens) // BLOCK) + 1
    working_set = args.system_tokens // BLOCK + args.sessions * private
    pool_small = args.small_pool_blocks or max(working_set // 2,
                                               args.system_tokens // BLOCK + 2 * args.concurrency * private)
    common = dict(model=args.model, device=args.device, max_model_len=longest + 64, block_size=BLOCK,
                  max_num_seqs=args.concurrency, speculative_algorithm=args.speculative_algorithm,
                  load_format=args.load_format)
    if args.speculative_algorithm == "EAGLE3":
        common.update(speculative_draft_model_path=args.draft, speculative_policy=args.speculative_policy,
                      speculative_disable_batch_threshold=args.speculative_disable_batch_threshold)
    configs = {k: v for k, v in configurations(args, pool_small, 2 * working_set).items()
               if k in args.configs.split(",")}
    engines = {name: LLMEngine(EngineConfig.from_options(**common, **opts)) for name, opts in configs.items()}
    system, messages = make_workload(next(iter(engines.values())).tokenizer, args)
    print(f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} in flight; system prompt "
          f"{len(system)} tokens, tool results {args.message_tokens}, replies {args.max_tokens}; working set "
          f"~{working_set} blocks of {BLOCK}; small pool {pool_small} blocks, host pool x{args.host_ratio}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    for engine in engines.values():  # warm-up (a different system prompt: nothing of it is reused)
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request(engine.tokenizer.encode(source_text(400, skip=123457)), warm)
        while engine.has_unfinished():
            engine.step()
    results: dict[str, dict] = {}
    rounds: list[dict] = []
    for r in range(args.rounds):
        for name, engine in engines.items():
            engine = engines[name] = fresh_cache(engine)
            res = run(engine, system, messages, args)
            res.update(cache_stats(engine), load_average=os.getloadavg()[0])
            rounds.append(dict({n: v for n, v in res.items() if n != "outputs"}, config=name, round=r + 1))
            if name not in results or res["mean_ttft_ms"] < results[name]["mean_ttft_ms"]:
                results[name] = res
            print(f"round {r + 1} {name:13s} mean TTFT {res['mean_ttft_ms']:8.1f} ms  "
                  f"{res['output_throughput']:7.1f} tok/s  hit rate {res['hit_rate']:.2f}  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    report(results, rounds, args, pool_small, working_set, len(system))


def fresh_cache(engine: LLMEngine) -> LLMEngine:
    """The same engine (warm, its controller trained) with an empty prefix cache and zeroed statistics."""
    from specserve.engine.block_manager import make_block_manager
    from specserve.engine.stats import EngineStats

    assert not engine.has_unfinished()
    engine.blocks = engine.scheduler.blocks = make_block_manager(engine.config.cache, engine.runner,
                                                                     engine.spec.proposer if engine.spec else None)
    engine.stats = EngineStats(prefix_cache=engine.blocks.stats)
    engine.scheduler.num_preemptions = 0
    return engine


def cache_stats(engine: LLMEngine) -> dict:
    c, host = engine.stats.prefix_cache, engine.blocks.host
    return {"hit_rate": c.hit_rate, "device_hit_rate": c.device_hit_rate, "host_hit_rate": c.host_hit_rate,
            "evicted_blocks": c.num_evicted_blocks,
            "host_saved_blocks": c.num_host_saved_blocks, "host_loaded_blocks": c.num_host_loaded_blocks,
            "host_slots": host.num_slots if host else 0, "preemptions": engine.stats.num_preemptions,
            "mean_acceptance_length": engine.stats.spec.mean_acceptance_length}


def report(results: dict, rounds: list[dict], args, pool_small: int, working_set: int, system_len: int) -> None:
    base = results.get("off")
    same = len({json.dumps(r["outputs"]) for r in results.values()}) == 1
    print("\n| config | mean TTFT ms | median | p90 | TTFT / off | output tok/s | hit rate (device + host) "
          "| evicted | host saves / loads (copy ms) | draft flush ms |\n|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{r['mean_ttft_ms'] / base['mean_ttft_ms']:.2f}" if base else "-"
        print(f"| {name} | {r['mean_ttft_ms']:.1f} | {r['median_ttft_ms']:.1f} | {r['p90_ttft_ms']:.1f} | {ratio} | "
              f"{r['output_throughput']:.1f} | {r['hit_rate']:.2f} "
              f"({r['device_hit_rate']:.2f} + {r['host_hit_rate']:.2f}) "
              f"| {r['evicted_blocks']} | {r['host_saved_blocks']} / {r['host_loaded_blocks']} "
              f"({r['host_save_ms']:.1f} / {r['host_load_ms']:.1f}) | {r['draft_flush_ms']:.1f} |")
    print(f"\noutputs identical across configurations: {same}")
    if args.out:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        meta = dict(vars(args), commit=commit, pool_small=pool_small, working_set_blocks=working_set,
                    system_prompt_tokens=system_len, outputs_identical=same, load_average_end=os.getloadavg()[0])
        best = {k: {n: v for n, v in r.items() if n != "outputs"} for k, r in results.items()}
        json.dump({"meta": meta, "results": best, "rounds": rounds}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
