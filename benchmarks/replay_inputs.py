"""Whether a decode graph's replay time depends on the token and position it holds: the (batch 1, 1) graph of one
engine replayed with its capture's inputs (token 0 at position 0), with a real decode's last step, then with that
step's token or position zeroed and with a few fixed tokens (each replay at blocks 0.. of `gpu_decode.set_context`).
Session 67 saw the 30B-A3B's batch-1 replay on an H100 read 3.15 or 3.28 ms depending on the decode it followed;
session 68 found every input here within 3.139-3.157 ms, and the 3.28 ms in engines that also capture a 512-token
mixed graph (`fresh_variants.py`), which this engine, like recapture.py's, does not.

    python benchmarks/replay_inputs.py --config benchmarks/configs/qwen3-30b-a3b --out replay_inputs.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gpu_decode  # noqa: E402

from specserve.engine import cuda_graph  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "qwen3-30b-a3b"))
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--decodes", type=int, default=3, help="real decodes, each followed by the replays")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 1000, 100000])
    ap.add_argument("--out", default="replay_inputs.json")
    args = ap.parse_args()
    arch = gpu_decode.ArchConfig.from_dict(gpu_decode.read_config(args.config))
    cuda_graph.MIXED_TOKENS = ()
    engine_args = SimpleNamespace(config=args.config, batches=[1], gen_len=64, max_model_len=None,
                                  max_kv_tokens=300_000)
    llm = gpu_decode.start_engine(engine_args, args.context)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    gen = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "config": args.config, "rows": []}

    def replay(label: str, decode: int) -> None:
        ms = gpu_decode.replay_ms(engine.runner, 1, args.context + 16, reps=50)
        row = {"decode": decode, "inputs": label, "token": graphs.ids[0].item(), "position": graphs.positions[0].item(),
               "replay_ms": ms}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)

    replay("capture's", -1)
    for decode in range(args.decodes):
        rate = gpu_decode.decode_rate(engine, 1, args.context, engine_args, arch, gen)
        print(json.dumps({"decode": decode, "tokens_per_s": rate}), flush=True)
        ids, positions = graphs.ids[:1].clone(), graphs.positions[:1].clone()
        replay("last step's", decode)
        graphs.ids[:1].zero_()
        replay("token 0", decode)
        graphs.ids[:1].copy_(ids)
        graphs.positions[:1].zero_()
        replay("position 0", decode)
        graphs.positions[:1].copy_(positions)
        for token in args.tokens:
            graphs.ids[:1].fill_(token)
            replay(f"token {token}", decode)
        graphs.ids[:1].copy_(ids)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    engine.close()


if __name__ == "__main__":
    main()
