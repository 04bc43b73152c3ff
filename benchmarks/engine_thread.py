"""Where the engine's torch work runs on a CPU: stepped in the thread that built it, in a second thread, or
built and stepped in one background thread (what `AsyncEngine` does).

    python benchmarks/engine_thread.py --dataset httpx.jsonl [--prompts 6] [--max-tokens 64] [--rounds 3]
        [--config chain|plain] [--out thread.json]

GNU OpenMP gives every thread that starts parallel work its own set of workers; with more workers alive than
cores it throttles their spinning and all of them sleep between operations. Per placement and round: output
tokens/s of greedy requests one at a time, and the process's voluntary context switches and CPU seconds
(`getrusage`): sleeping workers show as tens of thousands of switches and less CPU than two cores' worth.
"""
from __future__ import annotations

import argparse
import json
import resource
import threading
import time


def engine(config: str):
    from specserve import LLM
    if config == "plain":
        return LLM(speculative_algorithm="none")
    return LLM(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_policy="always")


def measure(llm, prompts: list, max_tokens: int) -> dict:
    """Requests one at a time, in the calling thread."""
    from specserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    r0, t0, tokens = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
    for p in prompts:
        tokens += len(llm.generate([p], params)[0].token_ids)
    seconds, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"tok_s": round(tokens / seconds, 1), "voluntary_switches": r1.ru_nvcsw - r0.ru_nvcsw,
            "cpu_s": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2), "wall_s": round(seconds, 2)}


def in_thread(fn, *args):
    box = {}
    t = threading.Thread(target=lambda: box.update(value=fn(*args)))
    t.start()
    t.join()
    return box["value"]


def one_thread(args, prompts: list) -> list[dict]:
    """Built and stepped in one background thread."""
    llm = engine(args.config)
    measure(llm, prompts[:1], args.max_tokens)
    return [measure(llm, prompts, args.max_tokens) for _ in range(args.rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, help="JSONL of {\"prompt\": ...} (benchmarks/package_prompts.py)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", choices=("chain", "plain"), default="chain")
    ap.add_argument("--out")
    args = ap.parse_args()
    prompts = [json.loads(line)["prompt"] for line in open(args.dataset)][:args.prompts]
    # the first placement runs alone in its process: its workers are the only ones
    results = {"built and stepped in one background thread": in_thread(one_thread, args, prompts)}
    llm = engine(args.config)  # built here, in the main thread
    measure(llm, prompts[:1], args.max_tokens)
    main_thread, other = [], []
    results["built and stepped in the main thread"], results["built there, stepped in another"] = main_thread, other
    for _ in range(args.rounds):
        main_thread.append(measure(llm, prompts, args.max_tokens))
        other.append(in_thread(measure, llm, prompts, args.max_tokens))
    for name, rounds in results.items():
        print(f"{name:48s}", "  ".join(f"{r['tok_s']:6.1f} tok/s {r['voluntary_switches']:6d} sw" for r in rounds))
    if args.out:
        json.dump({"config": args.config, "dataset": args.dataset, "results": results}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
