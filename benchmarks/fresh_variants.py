"""Settings that take effect only when an engine starts (which graphs it captures, engine options), each
variant in a fresh process, in rounds: the (batch, 1) decode graph's replay time before and after real decodes,
and the decode rate, as `recapture.py` reports them for settings a recapture can change.

    python benchmarks/fresh_variants.py --config benchmarks/configs/qwen3-30b-a3b --batches 1 --rounds 2 \
        --variants "engine.cuda_graph.MIXED_TOKENS=()" "engine.cuda_graph.MIXED_TOKENS=(32,)" "gemm_tuning_rows=0"

A variant is `recapture.py`'s: `module.NAME=value` settings separated by ";", a module of specserve.layers or a
path under specserve; an item without a module (`gemm_tuning_rows=0`) is an engine option, as `LLM(...)` takes it.
Session 68 found the 30B-A3B batch-1 decode graph 4% slower on an H100 in an engine that also captured a 512-token
mixed graph; recapture.py turns mixed graphs off, so it cannot see that. In that state its kernels no longer overlap
(session 69; `--profile` records the overlap). Sessions 70-71 (`graph_overlap.py`): any 3 or more other graphs in
the process bring that state, so every serving engine is in it; a profiler session slows every later replay.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def split_variant(text: str) -> tuple[str, dict]:
    """'module.NAME=v;option=v' -> ('module.NAME=v', {'option': v}): module settings, and engine options."""
    import ast

    settings, options = [], {}
    for item in text.split(";"):
        target, value = item.split("=", 1)
        if "." in target:
            settings.append(item)
        else:
            options[target.strip()] = ast.literal_eval(value.strip())
    return ";".join(settings), options


def child(args) -> None:
    """One engine under one variant: one JSON row per batch on stdout's last line."""
    import gpu_decode
    import recapture
    import torch

    settings, options = split_variant(args.child)
    for module, name, value in recapture.settings(settings) if settings else ():
        setattr(module, name, value)
    arch = gpu_decode.ArchConfig.from_dict(gpu_decode.read_config(args.config))
    engine_args = SimpleNamespace(config=args.config, batches=args.batches, gen_len=args.gen_len,
                                  max_model_len=None, max_kv_tokens=300_000)
    llm = gpu_decode.start_engine(engine_args, args.context, **options)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    rows = [{"device": torch.cuda.get_device_name(), "batch": batch, "graphs": len(engine.runner.graphs.graphs),
             **recapture.replays_around_decodes(engine, batch, args.context, engine_args, arch, gen, args.decodes)}
            for batch in args.batches]
    if args.profile:  # after every batch's replays are timed: a profiler session slows every later replay (s70)
        for row in rows:  # the kernels' sum and their overlap (programmatic dependent launch)
            last = row["decodes"][-1]["replay_after_decode_ms"] if row["decodes"] else row["replay_ms"]
            seen = gpu_decode.profile(engine.runner, row["batch"], args.context + 16, last)
            row["profile"] = {"kernels_ms": seen["kernels_ms"], "overlap_us": seen["overlap_us"]}
    engine.close()
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "llama-3.1-8b"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--variants", nargs="+", default=[])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=2, help="real decodes a batch, each followed by a replay")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--profile", action="store_true", help="profile the replay after the decodes (kernels, overlap)")
    ap.add_argument("--out", default="fresh_variants.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args)
    if not args.variants:
        ap.error("--variants: at least one variant to run")
    import recapture

    from specserve.config import option_table

    for text in args.variants:
        settings, options = split_variant(text)  # a misspelt setting fails here, before any engine starts
        if settings:
            recapture.settings(settings)
        for name in options:
            if name not in option_table():
                raise SystemExit(f"{name!r} is not an engine option")
    result = {"config": args.config, "context": args.context, "rows": []}
    common = ["--config", args.config, "--context", str(args.context), "--gen-len", str(args.gen_len),
              "--decodes", str(args.decodes), "--batches", *map(str, args.batches), *["--profile"] * args.profile]
    for round_ in range(args.rounds):
        for text in args.variants:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *common, "--child", text],
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"variant {text!r} failed:\n{done.stderr[-3000:]}")
            for row in json.loads(done.stdout.strip().splitlines()[-1]):
                row = {"round": round_, "variant": text, **row}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
