"""Where a sweep level's time goes: decode-only steps against steps with a prefill, per configuration.

    python benchmarks/level_split.py

The shipped pair on CUDA, held-out prompts, levels C = 5, 10, 30 of 30 requests x 100 tokens, two rounds:
per configuration (plain, chain-3, adaptive, and chain-3 / adaptive with every step that admits or
continues a prefill decoding plain: `_pp`) the throughput, the count and wall time of decode-only steps
and of steps with a prefill, and the accepted drafts per verify.
"""
import sys
import sysconfig
import time

sys.path.insert(0, "benchmarks")
from default_pair import held_out_texts  # noqa: E402
from sweep import configurations  # noqa: E402

from specserve.assets import SHIPPED_DRAFT, SHIPPED_TARGET  # noqa: E402
from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from specserve.speculative.controller import PLAIN  # noqa: E402

CONFIGS = configurations(SHIPPED_DRAFT)
names = ["plain", "chain", "chain_pp", "adaptive", "adaptive_pp"]
engines = {}
for name in names:
    opts = CONFIGS[name.replace("_pp", "")]
    engines[name] = LLMEngine(EngineConfig.from_options(model=SHIPPED_TARGET, device="cuda", max_num_seqs=250, **opts))
    if name.endswith("_pp"):
        eng = engines[name]
        orig = eng.spec.choose

        def choose(b, eng=eng, orig=orig):
            s = orig(b)
            busy = eng.scheduler.waiting or any(q.num_uncomputed_tokens > 1 for q in eng.scheduler.running)
            return PLAIN if busy else s
        eng.spec.choose = choose
tok = engines["plain"].tokenizer
prompts = [tok.encode(text[:2000])[:128] for _, text in held_out_texts(sysconfig.get_paths()["stdlib"], 94)]


def level(engine, conc, total, max_tokens=100):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    issued = finished = tokens = 0
    acc = {"decode": [0, 0.0], "prefill": [0, 0.0]}
    d0, a0 = engine.stats.spec.num_drafts, engine.stats.spec.num_accepted_tokens
    start = time.perf_counter()
    while finished < total:
        while issued < total and issued - finished < conc:
            engine.add_request(prompts[issued % len(prompts)], params)
            issued += 1
        p0, t0 = engine.stats.num_prompt_tokens, time.perf_counter()
        outs = engine.step()
        kind = "prefill" if engine.stats.num_prompt_tokens > p0 else "decode"
        acc[kind][0] += 1
        acc[kind][1] += time.perf_counter() - t0
        for out in outs:
            if out.finished:
                finished += 1
                tokens += len(out.token_ids)
    secs = time.perf_counter() - start
    drafts = engine.stats.spec.num_drafts - d0
    accepted = (engine.stats.spec.num_accepted_tokens - a0) / drafts if drafts else 0
    return tokens / secs, acc, drafts, accepted


for eng in engines.values():
    level(eng, 2, 4, 16)
for conc in (5, 10, 30):
    for rnd in range(2):
        base = None
        for name, eng in engines.items():
            tput, acc, drafts, accepted = level(eng, conc, 30)
            base = base or tput
            dec, pre = acc["decode"], acc["prefill"]
            print(f"C={conc} r{rnd} {name:12s} {tput:8.0f} tok/s ({tput / base:.2f}x)  decode steps {dec[0]:4d} "
                  f"{dec[1] * 1e3:7.1f} ms  prefill steps {pre[0]:3d} {pre[1] * 1e3:7.1f} ms  "
                  f"drafts {drafts} accepted/draft {accepted:.2f}", flush=True)
