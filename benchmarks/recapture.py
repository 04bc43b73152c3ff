"""One engine's decode graphs captured again and again, each time under a variant of module settings in
`specserve.layers` (a programmatic-dependent-launch mode, `triton_launch.MODE`; a kernel's launch settings), in
rounds: the graph replay time and the decode rate of each capture, side by side in one process. It separates
what a setting does from what one capture happens to give (session 36: the same mode-3 code replayed the 30B-A3B
batch-1 graph in 2.70 or 2.83 ms depending on the capture).

    python benchmarks/recapture.py --config benchmarks/configs/qwen3-30b-a3b --batches 1 --rounds 2 \
        --variants "triton_launch.MODE=3" "triton_launch.MODE=4" "triton_moe.DIRECT_UP=(8,512,4)"

A variant is one or more `module.NAME=value` settings separated by ";" (value a Python literal); each variant
starts from the settings the engine started with, and its capture tunes products afresh (`cublaslt.forget`), so
`"cublaslt.CLUSTERS=()"` against the default compares plans made with and without `LtMatmul.variants`.

Dummy bf16 weights, `--context`-token prompts, the (batch, 1) graph replayed at context + 16 keys, first with
the inputs its capture left (token 0 at position 0), then with its last decode step's (`replay_after_decode_ms`:
with the token and routing of a real step, as the engine replays it). The engine
is built without mixed graphs: their static inputs (each step's tiles) are left from the last step, which a
second capture's warm-up cannot run with.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gpu_decode  # noqa: E402

from specserve.engine import cuda_graph  # noqa: E402
from specserve.layers import cublaslt  # noqa: E402


def settings(variant: str) -> list[tuple[object, str, object]]:
    """'module.NAME=value;...' -> [(module, NAME, value)], checked against the modules' names; a module is one of
    specserve.layers (`triton_moe`) or a path under specserve (`engine.cuda_graph`)."""
    out = []
    for item in variant.split(";"):
        target, value = item.split("=", 1)
        module_name, name = target.strip().rsplit(".", 1)
        path = f"specserve.{module_name}" if "." in module_name else f"specserve.layers.{module_name}"
        module = importlib.import_module(path)
        if not hasattr(module, name):
            raise SystemExit(f"{path} has no {name}")
        out.append((module, name, ast.literal_eval(value.strip())))
    return out


def replays_around_decodes(engine, batch: int, context: int, engine_args, arch, gen, decodes: int = 1) -> dict:
    """The (batch, 1) graph's replay ms at context + 16 keys, then `decodes` real decodes of `batch` requests, each
    followed by the replay again: {"replay_ms", "decodes": [{"tokens_per_s", "replay_after_decode_ms"}, ...]}."""
    runner = engine.runner
    out = {"replay_ms": gpu_decode.replay_ms(runner, batch, context + 16, reps=50), "decodes": []}
    for _ in range(decodes):
        rate = gpu_decode.decode_rate(engine, batch, context, engine_args, arch, gen)
        after = gpu_decode.replay_ms(runner, batch, context + 16, reps=50)
        out["decodes"].append({"tokens_per_s": rate, "replay_after_decode_ms": after})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "llama-3.1-8b"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--variants", nargs="+", default=["triton_launch.MODE=3", "triton_launch.MODE=4"],
                    help="each: module.NAME=value[;module.NAME=value...], modules of specserve.layers")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--out", default="recapture.json")
    args = ap.parse_args()
    arch = gpu_decode.ArchConfig.from_dict(gpu_decode.read_config(args.config))
    cuda_graph.MIXED_TOKENS = ()
    engine_args = SimpleNamespace(config=args.config, batches=args.batches, gen_len=args.gen_len, max_model_len=None,
                                  max_kv_tokens=300_000)
    llm = gpu_decode.start_engine(engine_args, args.context)
    engine, runner = llm.engine, llm.engine.runner
    gen = torch.Generator().manual_seed(0)
    variants = [(text, settings(text)) for text in args.variants]
    defaults = {(m, name): getattr(m, name) for _, items in variants for m, name, _ in items}
    result = {"device": torch.cuda.get_device_name(), "config": args.config, "context": args.context, "rows": []}
    for round_ in range(args.rounds):
        for text, items in variants:
            for (module, name), value in defaults.items():
                setattr(module, name, value)
            for module, name, value in items:
                setattr(module, name, value)
            cublaslt.forget()  # products tuned afresh under this variant's settings
            runner.graphs.capture()
            for batch in args.batches:
                timed = replays_around_decodes(engine, batch, args.context, engine_args, arch, gen)
                row = {"round": round_, "variant": text, "batch": batch, "replay_ms": timed["replay_ms"],
                       **timed["decodes"][0]}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
