"""Whether the (batch, 1) decode graph's kernels overlap (programmatic dependent launch), step by step through
a sequence of graph captures, launches and drops in one engine: its replay ms, its kernels' ms and their
overlap (`gpu_decode.profile`'s `overlap_us`) after each step.

    python benchmarks/graph_overlap.py --config benchmarks/configs/qwen3-30b-a3b --sequence drop-mixed
    python benchmarks/graph_overlap.py --config benchmarks/configs/qwen3-30b-a3b --sequence more-graphs
    python benchmarks/graph_overlap.py --config benchmarks/configs/qwen3-30b-a3b --sequence launch-mixed
    python benchmarks/graph_overlap.py --config benchmarks/configs/qwen3-30b-a3b --sequence free-memory

Session 69 found (H100, 30B-A3B, batch 1) the same 487 kernels overlapping by ~190 us a replay in an engine
without mixed graphs (3.14 ms) and by ~0 in one with them (3.27 ms). Sessions 70-71 (graph_overlap_s70_h100.json,
graph_overlap_s71_h100.json) found, without a profiler: a process holding 3 or more graph executables besides the
decode graph replays it ~4% slower (3.23-3.24 against 3.10-3.11 ms) from the 2nd or 3rd step after they exist,
whatever they are (mixed graphs, graphs of other batch sizes, graphs of torch kernels never launched), with one
exception not understood: up to 14 copies of the decode graph itself, each launched once (more-graphs), did not slow
it. With 0-2 it stays fast. A serving engine holds dozens, so the fast figure belongs to one-graph processes. A
profiler session slows every later replay of its process, so only a process's first profiled step compares with
another's (use --no-profile for replay times). The sequences:
- drop-mixed (the default engine): recapture the decode graph; drop the mixed graphs and the old decode graph;
  recapture it alone;
- more-graphs (no mixed graphs): capture 2, 6, 14 more copies of the decode graph, then launch each once;
- launch-mixed (the default engine without cuBLASLt tuning, whose decode graph session 69 saw start fast): launch
  the smallest mixed graph once, then the largest (on whatever inputs the capture left: a benchmark's KV only);
- side-streams (the default engine): the decode graph replayed on a new stream, then a new high-priority one;
- restore (the default engine): the decode graph uploaded again (cuGraphUpload), the step run eagerly, 1 then 8
  more decode graphs captured and not launched;
- relaunch (no mixed graphs): 6 more decode graphs launched, the decode graph uploaded again, one of the 6
  launched again, the 6 dropped;
- prompts (the default engine without tuning; prompts-eager: no mixed graphs either): real requests served, a
  32-token prompt, a 256-token one, then 256 tokens in and 8 out; toggle: prompts of 256, 32, 256 tokens (session
  70 also replayed the mixed graphs on the inputs the prompts left, which raised an error it did not diagnose);
- tokens (the default engine without tuning): the graph's input token set to 0, 1, 7, ..., 0 (position 16);
  same-token: token 0, --repeat times; idle: the same with 1 s of idle before each step; drop-later: 3 steps of
  same-token, the mixed graphs dropped, --repeat more; dummy-graphs (no mixed graphs): --dummy COUNT NODES graphs of
  one-block torch kernels captured, then same-token;
- free-memory (no mixed graphs): 2 GiB allocated and freed into torch's cache, then `empty_cache` handing it back
  to the driver, as every `torch.cuda.graph` capture and the cuBLASLt tuning do (each session-69 trigger did).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import gpu_decode  # noqa: E402

from specserve.engine import cuda_graph  # noqa: E402
from specserve.layers import cublaslt, triton_launch  # noqa: E402


def mixed_graphs_pdl(mode: int) -> None:
    """Capture the mixed graphs under triton_launch.MODE = mode (the decode graphs keep the module's mode)."""
    run = cuda_graph.GraphRunner._run

    def _run(self, bs: int, q: int, adapters: bool = False):
        if bs:
            return run(self, bs, q, adapters)
        kept, triton_launch.MODE = triton_launch.MODE, mode
        try:
            return run(self, bs, q, adapters)
        finally:
            triton_launch.MODE = kept

    cuda_graph.GraphRunner._run = _run


def recapture(graphs, key: tuple) -> torch.cuda.CUDAGraph:
    with torch.inference_mode():
        captured, _ = cuda_graph.capture_all([key], graphs._run)
    return captured[key]


def queued_ms(runner, batch: int, context: int, reps: int) -> float:
    """Milliseconds a replay of the (batch, 1) decode graph takes when `reps` are launched back to back (the
    host's launch hidden behind the replays ahead; `gpu_decode.replay_ms` waits for each)."""
    gpu_decode.set_context(runner.graphs, runner, batch, 1, context)
    graph = runner.graphs.graphs[(batch, 1)]
    return gpu_decode.time_events(lambda: [graph.replay() for _ in range(reps)], 1, warmup=0) * 1e3 / reps


def release_mixed(graphs) -> None:
    """Drop the mixed graphs and hand their memory (and any other dropped graph's) back to the driver."""
    for key in [k for k in graphs.graphs if k[0] == 0]:
        del graphs.graphs[key]
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def drop_mixed(engine, batch: int, seen) -> None:
    graphs = engine.runner.graphs
    old = graphs.graphs[(batch, 1)]
    graphs.graphs[(batch, 1)] = recapture(graphs, (batch, 1))
    seen("decode graph recaptured, the others kept")
    del old
    release_mixed(graphs)
    seen("mixed graphs and the first decode graph dropped")
    graphs.graphs[(batch, 1)] = recapture(graphs, (batch, 1))
    seen("decode graph recaptured alone")


def more_graphs(engine, batch: int, seen) -> None:
    runner = engine.runner
    kept = []
    for total in (2, 6, 14):
        while len(kept) < total:
            kept.append(recapture(runner.graphs, (batch, 1)))
        torch.cuda.synchronize()
        seen(f"{total} more decode graphs captured, none launched")
        for graph in kept:
            graph.replay()
        torch.cuda.synchronize()
        seen(f"each of the {total} launched once")


def launch_mixed(engine, batch: int, seen) -> None:
    graphs = engine.runner.graphs
    sizes = sorted(key[1] for key in graphs.graphs if key[0] == 0)
    for tokens in (sizes[0], sizes[-1]):
        graphs.graphs[(0, tokens)].replay()
        torch.cuda.synchronize()
        seen(f"the {tokens}-token mixed graph launched once")


def free_memory(engine, batch: int, seen) -> None:
    block = torch.empty(2 << 30, dtype=torch.uint8, device=engine.runner.device)
    block.fill_(1)
    del block
    torch.cuda.synchronize()
    seen("2 GiB allocated and freed (cached)")
    torch.cuda.empty_cache()
    seen("empty_cache: handed back to the driver")


def side_streams(engine, batch: int, seen) -> None:
    for name, stream in (("a new stream", torch.cuda.Stream()), ("a new high-priority stream",
                                                                  torch.cuda.Stream(priority=-1))):
        with torch.cuda.stream(stream):
            seen(f"replayed on {name}")


def upload(graph: torch.cuda.CUDAGraph) -> None:
    """cuGraphUpload of the graph's executable on the current stream (the driver API; the runtime's handle)."""
    import ctypes
    status = ctypes.CDLL("libcuda.so.1").cuGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                                      ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert status == 0, f"cuGraphUpload returned {status}"


def restore(engine, batch: int, seen) -> None:
    graphs = engine.runner.graphs
    upload(graphs.graphs[(batch, 1)])
    torch.cuda.synchronize()
    seen("decode graph uploaded again")
    with torch.inference_mode():
        graphs._run(batch, 1)
    torch.cuda.synchronize()
    seen("the step run once eagerly")
    kept = []
    for total in (1, 8):
        while len(kept) < total:
            kept.append(recapture(graphs, (batch, 1)))
        torch.cuda.synchronize()
        seen(f"{total} more decode graphs captured, none launched")


def relaunch(engine, batch: int, seen) -> None:
    runner = engine.runner
    kept = [recapture(runner.graphs, (batch, 1)) for _ in range(6)]
    for graph in kept:
        graph.replay()
    torch.cuda.synchronize()
    seen("6 more decode graphs captured and launched once")
    upload(runner.graphs.graphs[(batch, 1)])
    torch.cuda.synchronize()
    seen("decode graph uploaded again")
    for graph in kept[:1]:
        graph.replay()
    torch.cuda.synchronize()
    seen("one of the 6 launched again")
    del kept
    gc.collect()
    torch.cuda.synchronize()
    seen("the 6 dropped")


def serve(engine, prompt_len: int, max_tokens: int) -> None:
    """One request of random tokens through the engine: its prompt (a mixed graph where the engine has them) and
    max_tokens - 1 decode steps."""
    from specserve import SamplingParams

    ids = torch.randint(10, 1000, (prompt_len,)).tolist()
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()


def prompts(engine, batch: int, seen) -> None:
    for prompt_len, max_tokens in ((32, 1), (256, 1), (256, 8)):
        serve(engine, prompt_len, max_tokens)
        seen(f"a {prompt_len}-token prompt served, {max_tokens} tokens out")


def toggle(engine, batch: int, seen) -> None:
    for prompt_len in (256, 32, 256):
        serve(engine, prompt_len, 1)
        seen(f"a {prompt_len}-token prompt served")


def tokens(engine, batch: int, seen, order=(0, 1, 7, 100, 1000, 5000, 50000, 0)) -> None:
    graphs = engine.runner.graphs
    for token in order:
        graphs.ids[:batch].fill_(token)
        graphs.positions[:batch].fill_(16)
        seen(f"input token {token} at position 16")


def same_token(engine, batch: int, seen, repeat: int = 8, pause_s: float = 0.0) -> None:
    for _ in range(repeat):
        time.sleep(pause_s)
        tokens(engine, batch, seen, (0,))


def dummy_graphs(engine, batch: int, seen, count: int = 3, nodes: int = 700, repeat: int = 6,
                 then: str = "none") -> None:
    """`count` graphs of `nodes` one-block torch kernels each, captured in one pool, then (`then`) left alone, each
    uploaded (cuGraphUpload) or each launched once, then same-token."""
    x = torch.zeros(256, device=engine.runner.device)
    kept, pool = [], None
    with cuda_graph.capturing():
        for _ in range(count):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                for _ in range(nodes):
                    x.add_(1.0)
            pool = graph.pool() if pool is None else pool
            kept.append(graph)
    for graph in kept:
        if then == "upload":
            upload(graph)
        elif then == "launch":
            graph.replay()
    torch.cuda.synchronize()
    seen(f"{count} graphs of {nodes} kernels captured, {then}")
    same_token(engine, batch, seen, repeat)


def drop_later(engine, batch: int, seen, repeat: int = 8) -> None:
    same_token(engine, batch, seen, 3)
    release_mixed(engine.runner.graphs)
    seen("mixed graphs dropped")
    same_token(engine, batch, seen, repeat)


# name -> (the steps, whether the engine has mixed graphs, its engine options)
SEQUENCES = {"drop-mixed": (drop_mixed, True, {}), "more-graphs": (more_graphs, False, {}),
             "launch-mixed": (launch_mixed, True, {"gemm_tuning_rows": 0}),
             "free-memory": (free_memory, False, {}), "side-streams": (side_streams, True, {}),
             "restore": (restore, True, {}), "relaunch": (relaunch, False, {}),
             "prompts": (prompts, True, {"gemm_tuning_rows": 0}),
             "toggle": (toggle, True, {"gemm_tuning_rows": 0}),
             "tokens": (tokens, True, {"gemm_tuning_rows": 0}),
             "same-token": (same_token, True, {"gemm_tuning_rows": 0}),
             "idle": (functools.partial(same_token, pause_s=1.0), True, {"gemm_tuning_rows": 0}),
             "drop-later": (drop_later, True, {"gemm_tuning_rows": 0}),
             "dummy-graphs": (dummy_graphs, False, {"gemm_tuning_rows": 0}),
             "prompts-eager": (prompts, False, {"gemm_tuning_rows": 0})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "qwen3-30b-a3b"))
    ap.add_argument("--sequence", choices=sorted(SEQUENCES), default="drop-mixed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", default="graph_overlap.json")
    ap.add_argument("--mixed-pdl", type=int, choices=(0, 1, 2, 3, 4), default=None,
                    help="capture the mixed graphs under this triton_launch.MODE")
    ap.add_argument("--eager-tuning", action="store_true",
                    help="cuBLASLt tuning on, timed eagerly (cublaslt.IN_GRAPH = False), whatever the sequence says")
    ap.add_argument("--mixed-tokens", type=int, nargs="+", default=None,
                    help="the mixed graphs' token counts (cuda_graph.MIXED_TOKENS) where the sequence has them")
    ap.add_argument("--repeat", type=int, default=8, help="steps of same-token, idle and drop-later")
    ap.add_argument("--dummy", type=int, nargs=2, default=(3, 700), metavar=("COUNT", "NODES"),
                    help="dummy-graphs: how many graphs, of how many kernels each")
    ap.add_argument("--dummy-then", choices=("none", "upload", "launch"), default="none",
                    help="dummy-graphs: what is done with each graph after the captures")
    ap.add_argument("--reps", type=int, default=50, help="timed replays a step (after 3 untimed)")
    ap.add_argument("--power", action="store_true",
                    help="each step's board power and SM clock (nvidia-smi every 100 ms) over 200 more replays")
    ap.add_argument("--queued", action="store_true",
                    help="also time --reps replays launched back to back (no host wait between them)")
    ap.add_argument("--no-profile", action="store_true",
                    help="replay times only: a profiler session slows the replays after it (session 70)")
    args = ap.parse_args()
    run, mixed, options = SEQUENCES[args.sequence]
    if not mixed:
        cuda_graph.MIXED_TOKENS = ()
    elif args.mixed_tokens:
        cuda_graph.MIXED_TOKENS = tuple(args.mixed_tokens)
    if args.sequence in ("same-token", "idle", "drop-later"):
        run = functools.partial(run, repeat=args.repeat)
    if args.sequence == "dummy-graphs":
        run = functools.partial(run, repeat=args.repeat, count=args.dummy[0], nodes=args.dummy[1],
                                then=args.dummy_then)
    if args.mixed_pdl is not None:
        mixed_graphs_pdl(args.mixed_pdl)
    if args.eager_tuning:
        cublaslt.IN_GRAPH = False
        options = {k: v for k, v in options.items() if k != "gemm_tuning_rows"}
    engine_args = SimpleNamespace(config=args.config, batches=[args.batch], gen_len=32, max_model_len=None,
                                  max_kv_tokens=300_000)
    llm = gpu_decode.start_engine(engine_args, args.context, **options)
    runner = llm.engine.runner
    result = {"config": args.config, "sequence": args.sequence, "device": torch.cuda.get_device_name(), "steps": []}

    def seen(step: str) -> None:
        replay = gpu_decode.replay_ms(runner, args.batch, args.context + 16, reps=args.reps)
        queued = queued_ms(runner, args.batch, args.context + 16, args.reps) if args.queued else None
        power = {}
        if args.power:
            with gpu_decode.PowerLog() as log:
                gpu_decode.replay_ms(runner, args.batch, args.context + 16, reps=200)
            power = log.summary()
        profiled = ({"kernels_ms": None, "overlap_us": None, "alongside": None} if args.no_profile else
                    gpu_decode.profile(runner, args.batch, args.context + 16, replay))
        row = {"step": step, "graphs": len(runner.graphs.graphs), "replay_ms": replay, "queued_ms": queued,
               "kernels_ms": profiled["kernels_ms"], "overlap_us": profiled["overlap_us"],
               "alongside": profiled["alongside"], "power": power}
        result["steps"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    try:
        seen("start")
        run(llm.engine, args.batch, seen)
    finally:
        llm.engine.close()


if __name__ == "__main__":
    main()
