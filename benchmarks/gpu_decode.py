"""Decode speed on a GPU against the roofline, specserve beside Hugging Face transformers' static cache.

One run measures, on the device it runs on:
- the two ceilings: device-to-device copy bandwidth and bf16 matmul rate (in a burst; the matmul rate also after 2 s
  of products, at the board's power cap, for a second roofline beside the first);
- specserve (dummy weights from a config.json, CUDA graphs, Triton paged attention): start-up and graph
  capture time, decode tokens/s at each batch size through the whole engine (scheduler, sampling,
  bookkeeping included), each against its roofline: step time = max(bytes read and written per step /
  copy bandwidth, FLOPs per step / matmul rate), and the board's power and SM clock while it decodes;
- the cost of a verify step with 2, 4, 8 tokens per request relative to a 1-token step, per batch size
  (graph replays of the target forward);
- transformers `generate` with `cache_implementation="static"` on the same shape and weights' dtype;
- for a mixture-of-experts shape, the roofline counts the experts a step's tokens route to, and the same
  engine with a per-expert loop (transformers' eager MoE) runs beside it.

    python benchmarks/gpu_decode.py --out gpu_decode.json            # Llama-3.1-8B shape
    python benchmarks/gpu_decode.py --part hf --out hf.json          # only the transformers half
    python benchmarks/gpu_decode.py --config benchmarks/configs/qwen3-30b-a3b --part specserve loop --out moe.json
    python benchmarks/gpu_decode.py --part specserve --contexts 256 4096 16384 32768 --batches 1 16 64 256 \
        --out long.json                                               # a context-length axis

Each context length (prompt tokens) gets its own engine, with max_model_len = context + gen_len + 32 unless
--max-model-len says otherwise (to see what a long max_model_len costs short contexts); a (context, batch) cell
whose KV exceeds --max-kv-tokens is left out. Prompts longer than 8192 tokens are prefilled in chunks.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from specserve.models.config import ArchConfig, read_config  # noqa: E402


def ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, measured here."""
    src = torch.randn(2 * 2**30 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    copy_s = time_events(lambda: dst.copy_(src), 20)
    mm_s = time_events(lambda: a @ b, 20)
    return {"copy_bytes_per_s": 2 * src.numel() * 2 / copy_s, "bf16_flops_per_s": 2 * 8192 ** 3 / mm_s}


def sustained_matmul_rate(device, seconds: float = 2.0) -> float:
    """bf16 matmul FLOP/s after `seconds` of back-to-back products: the rate a compute-bound step keeps once the
    board reaches its power cap (`ceilings` times a burst of 23 products, ~30 ms, before the cap engages)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ b  # noqa: B018
        torch.cuda.synchronize(device)
    return 2 * 8192 ** 3 / time_events(lambda: a @ b, 20, warmup=0)


def time_events(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


@dataclass
class WeightLayout:
    """Parameters one step reads: `dense` whatever the tokens (the lm_head counted, the embedding's few rows
    not), and per mixture-of-experts layer `per_expert` parameters for each expert its tokens route to."""
    dense: int
    moe: list  # per MoE layer: (experts, top_k, per_expert)

    @classmethod
    def of(cls, arch: ArchConfig) -> "WeightLayout":
        from specserve.layers.moe import Experts, SparseMoeBlock
        from specserve.models.loader import build
        from specserve.models.registry import model_class

        model = build(model_class(arch.architecture), arch, torch.bfloat16, torch.device("meta"))
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
        embed = 0 if arch.tie_word_embeddings else model.embedding().weight.numel()
        moe = [(m.num_experts, m.top_k, sum(p.numel() for p in m.experts.parameters()) // m.num_experts)
               for m in model.modules() if isinstance(m, SparseMoeBlock)]
        return cls(total - experts - embed, moe)

    def read(self, tokens: int) -> float:
        """Parameters read by a step of `tokens` tokens: each MoE layer reads the experts routed to, expected
        E * (1 - (1 - k/E)^tokens) of them under uniform routing (k at one token)."""
        return self.dense + sum(per * e * (1 - (1 - k / e) ** tokens) for e, k, per in self.moe)

    def active(self) -> int:
        """Parameters one token multiplies through."""
        return self.dense + sum(k * per for _, k, per in self.moe)


def roofline(arch: ArchConfig, layout: WeightLayout, batch: int, context: float, q: int, ceil: dict) -> float:
    """Fastest possible seconds for one step of `batch` requests, q new tokens each, over `context` keys."""
    kv_dim = arch.num_kv_heads * arch.head_dim
    kv_bytes = batch * (context + q) * arch.num_layers * 2 * kv_dim * 2
    tokens = batch * q
    flops = 2 * layout.active() * tokens + 4 * tokens * context * arch.num_layers * arch.num_heads * arch.head_dim
    return max((2 * layout.read(tokens) + kv_bytes) / ceil["copy_bytes_per_s"], flops / ceil["bf16_flops_per_s"])


class PowerLog:
    """The board power and SM clock of the current CUDA device, sampled by nvidia-smi every 100 ms while inside
    (no samples where nvidia-smi is missing). Sustained compute-bound decode steps run at the board's power cap,
    at a lower clock than a burst of graph replays (session 59: an H100 at its 700 W cap ran the 8B batch-256
    decode at a median 1,545 MHz, against 1,980 at small batches). nvidia-smi's power.draw is a one-second average
    on Hopper cards, so a run shorter than that partly reads the one before it."""

    def __enter__(self) -> "PowerLog":
        self.samples: list[tuple[float, float]] = []  # (watts, MHz)
        self.uuid = str(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", ""))
        command = ["nvidia-smi", "--query-gpu=uuid,power.draw,clocks.sm", "--format=csv,noheader,nounits", "-lms",
                   "100"]
        try:
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        for line in self.proc.communicate(timeout=10)[0].splitlines():
            try:
                uuid, watts, mhz = (x.strip() for x in line.split(","))
                if uuid.removeprefix("GPU-") == self.uuid.removeprefix("GPU-") or not self.uuid:
                    self.samples.append((float(watts), float(mhz)))
            except ValueError:
                continue

    def summary(self) -> dict:
        """Mean and peak watts, mean and lowest SM clock over the samples ({} without any)."""
        if not self.samples:
            return {}
        watts, mhz = zip(*self.samples)
        return {"watts": statistics.fmean(watts), "max_watts": max(watts), "sm_mhz": statistics.fmean(mhz),
                "min_sm_mhz": min(mhz), "power_samples": len(watts)}


def batches_at(args, context: int) -> list[int]:
    """The batch sizes measured at this context: those whose KV fits --max-kv-tokens."""
    return [b for b in args.batches if b * (context + args.gen_len) <= args.max_kv_tokens]


def start_engine(args, context: int, **options):
    from specserve import LLM

    return LLM(args.config, load_format="dummy", dtype="bfloat16", speculative_algorithm="none",
               max_model_len=args.max_model_len or context + args.gen_len + 32,
               max_num_seqs=max(batches_at(args, context)), max_num_batched_tokens=8192, kv_host_ratio=0.0, **options)


def specserve_part(args, arch, layout, ceil, context: int) -> dict:
    from specserve.engine.cuda_graph import GraphRunner

    batches = batches_at(args, context)
    max_bs = max(batches)
    t0 = time.perf_counter()
    llm = start_engine(args, context)
    engine = llm.engine
    graphs = engine.runner.graphs
    out = {"startup_s": time.perf_counter() - t0, "capture_s": graphs.capture_seconds,
           "capture_mib": graphs.capture_bytes / 2**20,
           "num_graphs": len(graphs.graphs), "max_model_len": engine.config.model.max_model_len,
           "kv_tokens": engine.runner.num_blocks * engine.runner.block_size, "decode": {}, "verify_cost": {}}
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        best = batch / roofline(arch, layout, batch, context + args.gen_len / 2, 1, ceil)
        sustained = {**ceil, "bf16_flops_per_s": ceil.get("bf16_flops_per_s_sustained", ceil["bf16_flops_per_s"])}
        best_sustained = batch / roofline(arch, layout, batch, context + args.gen_len / 2, 1, sustained)
        row = {"roofline_tokens_per_s": best, "roofline_sustained_tokens_per_s": best_sustained}
        for overlap in (True, False):
            engine.overlap = overlap
            with PowerLog() as power:
                tps = decode_rate(engine, batch, context, args, arch, gen)
            row["tokens_per_s" if overlap else "tokens_per_s_without_overlap"] = tps
            if overlap:
                row.update(power.summary())
            watts = f", {row['watts']:.0f} W at {row['sm_mhz']:.0f} MHz" if overlap and "watts" in row else ""
            print(f"specserve context {context} batch {batch} overlap {'on ' if overlap else 'off'}: "
                  f"{tps:,.0f} tok/s = {tps / best:.0%} of roofline {best:,.0f}{watts}", flush=True)
        row["fraction"] = row["tokens_per_s"] / best
        row["fraction_sustained"] = row["tokens_per_s"] / best_sustained
        print(f"specserve context {context} batch {batch}: {row['fraction_sustained']:.0%} of the roofline at the "
              f"sustained matmul rate ({best_sustained:,.0f} tok/s)", flush=True)
        out["decode"][batch] = row
    engine.overlap = True
    runner = engine.runner
    mid = context + args.gen_len // 2  # the decode's mean context, as the roofline counts it
    verify_bs = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_bs]
    graphs = GraphRunner(runner.model, runner.backend, runner.kv_cache, runner.block_size, max(verify_bs),
                         runner.graphs.block_tables.shape[1], [1, 2, 4, 8], (), runner.group, runner.scratch_slot,
                         runner.device)
    graphs.capture()
    for batch in verify_bs:
        row = {}
        for q in (1, 2, 4, 8):
            if (batch, q) not in graphs.graphs:
                continue
            set_context(graphs, runner, batch, q, context)
            row[q] = time_events(graphs.graphs[(batch, q)].replay, 20)
        out["verify_cost"][batch] = {q: {"ms": t * 1e3, "vs_1": t / row[1]} for q, t in row.items()}
        costs = ", ".join(f"{q} tok {t / row[1]:.2f}x" for q, t in row.items())
        print(f"verify cost context {context} batch {batch}: {costs}", flush=True)
    # last, and every replay timed first: after a profiler session the replays in this process run slower
    # (30B-A3B batch 1: 2.70 -> 2.95 ms; session 37)
    profiled = [b for b in (1, max_bs) if (b, 1) in runner.graphs.graphs]
    replays = {b: replay_ms(runner, b, mid) for b in profiled}
    out["profile"] = {b: profile(runner, b, mid, replays[b]) for b in profiled}
    engine.close()
    del llm, engine, runner, graphs
    release_memory()
    return out


def release_memory() -> None:
    """Give a part's memory back before the next part starts an engine (the 30B-A3B shape's weights take 61 GB:
    two engines do not fit on an 80 GB card). Deleting the names alone left 79 GiB in use on an H100; with the
    engine closed and a collection, 0.2 GiB."""
    gc.collect()
    torch.cuda.empty_cache()
    print(f"memory in use after the part: {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)


def decode_rate(engine, batch: int, context: int, args, arch, gen) -> float:
    """Output tokens/s of the engine's steps while all `batch` requests decode (prefill excluded)."""
    from specserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(10, arch.vocab_size, (context,), generator=gen).tolist(), params)
    decode_s, decode_tokens, settled = 0.0, 0, False
    while engine.has_unfinished():
        running = engine.scheduler.running
        all_decoding = len(running) == batch and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running)
        t = time.perf_counter()
        outs = engine.step()
        if all_decoding and not settled:  # with overlap this step waited for the prefill queued before it
            settled = True
        elif all_decoding and len(outs) == batch:
            decode_s += time.perf_counter() - t
            decode_tokens += batch
    if not decode_tokens:
        raise RuntimeError(f"no step decoded all {batch} requests of {context} tokens at once (the first finished "
                           f"its {args.gen_len} tokens before the last one's prompt was in): raise --gen-len")
    return decode_tokens / decode_s


def set_context(graphs, runner, batch: int, q: int, context: int) -> None:
    """Point the static inputs of graphs' (batch, q) replays at `context` keys a row, each row on its own blocks
    (so attention reads what a real step would), the new tokens' KV written to the scratch slot."""
    blocks = -(-(context + q) // runner.block_size)
    table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, -1) % runner.num_blocks
    graphs.block_tables[:batch, :blocks].copy_(table)
    graphs.seq_lens[:batch].fill_(context + q)
    graphs.slots[:batch * q].fill_(runner.scratch_slot)


def replay_ms(runner, batch: int, context: int, reps: int = 20) -> float:
    """Milliseconds a replay of the engine's (batch, 1) decode graph at `context` keys a row takes."""
    set_context(runner.graphs, runner, batch, 1, context)
    return time_events(runner.graphs.graphs[(batch, 1)].replay, reps) * 1e3


def profile(runner, batch: int, context: int, replay: float) -> dict:
    """The engine's (batch, 1) decode graph at `context` keys a row: its replay time (`replay_ms`, timed before any
    profiler ran), the sum of its kernels' times (the difference: time between kernels), the CUDA time per kernel
    name, largest first, the time between kernels by the kernels on either side (`boundaries`) and the time kernels
    ran alongside the one ahead (`overlap_us`). With programmatic dependent launch a kernel's time includes its wait
    for the one ahead, so the sum can exceed the replay."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    graph = runner.graphs.graphs[(batch, 1)]
    set_context(runner.graphs, runner, batch, 1, context)
    graph.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]
    table = [{"kernel": e.key[:90], "calls_per_step": e.count / 3, "us_per_step": e.device_time_total / 3}
             for e in rows]
    total = sum(e.device_time_total for e in prof.key_averages()) / 3
    print(f"profile batch {batch}, context {context}: {total / 1e3:.2f} ms of kernels per step, a {replay:.2f} ms "
          "replay; top: " +
          "; ".join(f"{r['kernel'][:40]} {r['us_per_step']:.0f}us x{r['calls_per_step']:.0f}" for r in table[:8]),
          flush=True)
    between = boundaries(spans, 3)
    alongside = sum(b["overlap_us_per_step"] for b in between)  # what programmatic dependent launch buys
    print(f"  between kernels {sum(b['us_per_step'] for b in between):.0f} us a step, kernels alongside the one "
          f"ahead {alongside:.0f} us; largest gaps: " +
          "; ".join(f"{b['after'][:24]} -> {b['before'][:24]} {b['us_per_step']:.0f}us x{b['per_step']:.0f}"
                    for b in between[:6]), flush=True)
    return {"replay_ms": replay, "kernels_ms": total / 1e3, "overlap_us": alongside, "kernels": table,
            "between": between[:16], "alongside": sorted(between, key=lambda b: -b["overlap_us_per_step"])[:16]}


def kernel_family(name: str) -> str:
    """A kernel's name as `boundaries` groups it: cuBLAS's GEMMs as one family, others by name."""
    return "cublas" if name.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "cutlass", "ampere")) else name


def boundaries(spans: list[tuple[str, float, float]], steps: int) -> list[dict]:
    """Idle time between consecutive kernels (name, start us, end us) on the GPU, per step, by the pair of
    kernel families on either side, largest first: where a graph's replay outlasts its kernels' sum; and the
    time the second ran alongside the first (programmatic dependent launch lets it start early)."""
    ordered = sorted(spans, key=lambda s: s[1])
    pairs = {}
    for (a, _, a_end), (b, start, b_end) in zip(ordered, ordered[1:]):
        key = (kernel_family(a), kernel_family(b))
        gap, alongside, count = pairs.get(key, (0.0, 0.0, 0))
        pairs[key] = (gap + max(0.0, start - a_end), alongside + max(0.0, min(a_end, b_end) - start), count + 1)
    return sorted(({"after": a, "before": b, "us_per_step": gap / steps, "overlap_us_per_step": alongside / steps,
                    "per_step": count / steps} for (a, b), (gap, alongside, count) in pairs.items()),
                  key=lambda r: -r["us_per_step"])


def loop_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Experts.forward as transformers' eager MoE computes it: one expert at a time, each routed to read on the
    host. x [n, hidden], weights and experts [n, top_k] -> [n, hidden]."""
    import torch.nn.functional as F

    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)  # [m] each
        gate, up = F.linear(x[rows], self.w13[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.w2[e]) * weights[rows, slot, None])
    return self.tp.all_reduce(out)


def loop_part(args, arch, layout, ceil, context: int) -> dict:
    """Decode through the same engine with each MoE layer's experts run one at a time (eager: the loop reads
    the routing on the host)."""
    from specserve.layers.moe import Experts

    forward, Experts.forward = Experts.forward, loop_experts
    try:
        llm = start_engine(args, context, enforce_eager=True)
        out, gen = {"decode": {}}, torch.Generator().manual_seed(0)
        for batch in batches_at(args, context):
            best = batch / roofline(arch, layout, batch, context + args.gen_len / 2, 1, ceil)
            tps = decode_rate(llm.engine, batch, context, args, arch, gen)
            out["decode"][batch] = {"tokens_per_s": tps, "fraction": tps / best}
            print(f"per-expert loop batch {batch}: {tps:,.0f} tok/s = {tps / best:.0%} of roofline", flush=True)
        llm.engine.close()
        del llm
        return out
    finally:
        Experts.forward = forward
        release_memory()


def hf_part(args, arch, layout, ceil, context: int) -> dict:
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(args.config)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    out = {"transformers": tf.__version__, "decode": {}}
    for batch in batches_at(args, context):
        ids = torch.randint(10, arch.vocab_size, (batch, context), device="cuda")

        def generate(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, cache_implementation="static", pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        generate(args.gen_len)  # compile / warm up
        full, one = generate(args.gen_len), generate(1)
        tps = batch * (args.gen_len - 1) / (full - one)
        best = batch / roofline(arch, layout, batch, context + args.gen_len / 2, 1, ceil)
        out["decode"][batch] = {"tokens_per_s": tps, "fraction": tps / best}
        print(f"transformers batch {batch}: {tps:,.0f} tok/s = {tps / best:.0%} of roofline", flush=True)
    model = None  # frees it: `generate` shares the name, so no del
    release_memory()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "llama-3.1-8b"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", "--prompt-len", type=int, nargs="+", default=[256],
                    help="prompt lengths in tokens, one engine each")
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="every engine's max_model_len (default: its context + gen_len + 32)")
    ap.add_argument("--max-kv-tokens", type=int, default=300_000,
                    help="leave out (context, batch) cells holding more KV tokens than this")
    ap.add_argument("--part", nargs="+", choices=("all", "specserve", "hf", "loop"), default=["all"],
                    help="all: specserve and transformers, and the per-expert loop for a MoE shape")
    ap.add_argument("--gemv-rows", type=int, default=None,
                    help="few-row products up to this many rows run as triton_gemv (default: linear.GEMV_ROWS; "
                    "0: all cuBLAS), to compare the two")
    ap.add_argument("--fused-rows", type=int, default=None,
                    help="steps of up to this many tokens run the fused decoder path (default: llama.FUSED_ROWS; "
                    "0: every step layer by layer), to compare the two")
    ap.add_argument("--pdl", type=int, choices=(0, 1, 2, 3, 4), default=None,
                    help="triton_launch.MODE (0: Triton kernels launch without programmatic dependent launch; 4: "
                    "resident grids let the next kernel launch early), to compare")
    ap.add_argument("--out", default="gpu_decode.json")
    args = ap.parse_args()
    from specserve.layers import triton_launch
    if args.pdl is not None:
        triton_launch.MODE = args.pdl
    if args.gemv_rows is not None:
        from specserve.layers import linear
        linear.GEMV_ROWS = args.gemv_rows
    if args.fused_rows is not None:
        from specserve.models import llama
        llama.FUSED_ROWS = args.fused_rows
    arch = ArchConfig.from_dict(read_config(args.config))
    layout = WeightLayout.of(arch)
    parts = set(args.part) - {"all"} | ({"specserve", "hf"} | ({"loop"} if layout.moe else set())
                                        if "all" in args.part else set())
    from specserve.layers import linear
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": args.config,
              "gemv_rows": linear.GEMV_ROWS, "fused_rows": args.fused_rows, "pdl": triton_launch.MODE,
              "contexts": args.contexts, "gen_len": args.gen_len, "max_model_len": args.max_model_len,
              "ceilings": ceilings("cuda")}
    result["ceilings"]["bf16_flops_per_s_sustained"] = sustained_matmul_rate("cuda")
    print(f"copy {result['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 {result['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s "
          f"({result['ceilings']['bf16_flops_per_s_sustained'] / 1e12:.0f} sustained)", flush=True)
    print(f"weights read per step: {layout.read(1) * 2 / 1e9:.2f} GB at 1 token, {layout.read(256) * 2 / 1e9:.2f} GB at"
          f" 256; active parameters {layout.active() / 1e9:.2f} B", flush=True)
    for context in args.contexts:
        if not batches_at(args, context):
            continue
        for part, fn in (("specserve", specserve_part), ("loop", loop_part), ("hf", hf_part)):
            if part in parts:
                result.setdefault(part, {})[context] = fn(args, arch, layout, result["ceilings"], context)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    summary(result, args)


def summary(result: dict, args) -> None:
    """One line per (context, batch): specserve's tokens/s and share of the roofline, beside the others'."""
    for context, cell in result.get("specserve", {}).items():
        for b in batches_at(args, context):
            s = cell["decode"][b]
            line = f"context {context:>6} batch {b:>4}: specserve {s['tokens_per_s']:>9,.0f} ({s['fraction']:.0%}"
            line += f"; {s['fraction_sustained']:.0%} sustained)" if "fraction_sustained" in s else ")"
            for other, name in (("hf", "transformers"), ("loop", "per-expert loop")):
                if context in result.get(other, {}):
                    h = result[other][context]["decode"][b]
                    line += (f"  {name} {h['tokens_per_s']:>9,.0f} ({h['fraction']:.0%})  "
                             f"ratio {s['tokens_per_s'] / h['tokens_per_s']:.2f}x")
            print(line)


if __name__ == "__main__":
    main()
