"""Prompt logprobs (`SamplingParams.prompt_logprobs`) against transformers' log-softmax over the prompt (fp32):
whole prompts, chunked prefill, preemption, two tensor-parallel ranks, prompts whose blocks are cached already,
a speculative engine, and requests without them in the same batches."""
from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams
from specserve.assets import default_draft_path, default_model_path
from specserve.engine.cuda_graph import GraphRunner

from .conftest import assert_pool_full, make_llm, mixed_prompts, skip_without_ranks

TOP = 3


def hf_prompt_logprobs(path: str, prompts: list[list[int]], top: int) -> list[list]:
    """Per prompt: None, then per later token (its logprob, the top (id, logprob) after the tokens before it,
    its rank)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            logp = model(torch.tensor([p])).logits[0].float().log_softmax(-1)  # [L, vocab]
            values, ids = logp.topk(top, dim=-1)
            out.append([None] + [(logp[i - 1, p[i]].item(), list(zip(ids[i - 1].tolist(), values[i - 1].tolist())),
                                  int((logp[i - 1] > logp[i - 1, p[i]]).sum()) + 1) for i in range(1, len(p))])
    return out


def assert_close(got: list, want: list, top: int = TOP) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, (logprob, alternatives, rank) in zip(got[1:], want[1:]):
        assert g.logprob == pytest.approx(logprob, abs=1e-4) and g.rank == rank
        assert [t for t, _ in g.top] == [t for t, _ in alternatives[:top]]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in alternatives[:top]], abs=1e-4)


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(6, 256, seed=3, lo=1, hi=70)


@pytest.fixture(scope="module")
def want(hf_models, prompts):
    return hf_prompt_logprobs(hf_models["qwen3"], prompts, TOP)


CASES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 16, "block_size": 8, "max_model_len": 128},
    "two_ranks": {"tensor_parallel_size": 2, "max_num_batched_tokens": 32},
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_match_transformers(hf_models, prompts, want, case):
    skip_without_ranks(CASES[case])
    llm = make_llm(hf_models["qwen3"], **CASES[case])
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=TOP if i % 3 else None)
              for i in range(len(prompts))]  # every third request without them, in the same batches
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        if i % 3 == 0:
            assert out.prompt_logprobs is None
        else:
            assert_close(out.prompt_logprobs, want[i])
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
    assert_pool_full(llm)


def test_cached_blocks_are_computed_again(hf_models, prompts, want):
    llm = make_llm(hf_models["qwen3"], block_size=8)
    long = [p for p in prompts if len(p) > 20]
    llm.generate(long, SamplingParams(temperature=0, max_tokens=2))  # their blocks are cached now
    hits = llm.engine.blocks.stats.num_hits
    outs = llm.generate(long, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert llm.engine.blocks.stats.num_hits == hits, "a request with prompt logprobs starts on no cached block"
    for out, p in zip(outs, long):
        assert_close(out.prompt_logprobs, want[prompts.index(p)], top=0)
        assert all(lp.top == [] for lp in out.prompt_logprobs[1:])
    outs = llm.generate(long, SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.blocks.stats.num_hits > hits, "the others still do"
    assert_pool_full(llm)


def test_speculative_engine_gives_the_same(prompts):
    path = default_model_path()
    ids = [[t % 4096 for t in p] for p in prompts]
    want = hf_prompt_logprobs(path, ids, TOP)
    llm = make_llm(path, speculative_algorithm="EAGLE3", speculative_draft_model_path=default_draft_path(),
                   speculative_num_steps=3, speculative_policy="always", max_num_batched_tokens=32)
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=TOP))
    for out, w in zip(outs, want):
        assert_close(out.prompt_logprobs, w)
    assert llm.engine.stats.spec.num_accepted_tokens > 0
    assert_pool_full(llm)


def test_bad_values_are_refused():
    for value in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
            SamplingParams(prompt_logprobs=value)


def test_max_logprobs_bounds_what_a_request_may_ask(hf_models, prompts):
    """vLLM's max_logprobs: 20 by default, refused above it with an error naming it; raised, the engine gives that
    many alternatives (transformers' top 40 at each prompt token); -1: up to the vocabulary."""
    default = make_llm(hf_models["qwen3"])
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} asks for 21 .* max_logprobs, 20"):
            default.generate(prompts[:1], SamplingParams(max_tokens=2, **{field: 21}))
    assert default.generate(prompts[:1], SamplingParams(max_tokens=2, logprobs=20))[0].logprobs[0].top
    llm = make_llm(hf_models["qwen3"], max_logprobs=40)
    [out] = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=40, logprobs=40))
    want = hf_prompt_logprobs(hf_models["qwen3"], prompts[:1], 40)[0]
    for got, (logprob, alternatives, _) in zip(out.prompt_logprobs[1:], want[1:]):
        assert got.logprob == pytest.approx(logprob, abs=1e-4) and len(got.top) == 40
        assert [v for _, v in got.top] == pytest.approx([v for _, v in alternatives], abs=1e-4)
        clear = {t for t, v in alternatives if v > alternatives[-1][1] + 1e-4}  # ids whose place no tie can move
        assert clear <= {t for t, _ in got.top}
    assert all(len(lp.top) == 40 for lp in out.logprobs)
    with pytest.raises(ValueError, match="max_logprobs, 40"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, logprobs=41))
    vocab = make_llm(hf_models["qwen3"], max_logprobs=-1)
    assert vocab.engine.max_logprobs == vocab.engine.arch.vocab_size
    assert len(vocab.generate(prompts[:1], SamplingParams(max_tokens=1, logprobs=100))[0].logprobs[0].top) == 100


class EagerGraphs:
    """A stand-in for the CUDA graph runner (graphs need CUDA): `GraphRunner.graph_for`'s own choice over
    decode graphs of 1-8 rows and mixed graphs of up to 512 tokens, each replayed eagerly, so the runner's
    graph branch runs on the CPU too."""

    follow, lora_slots = None, 0
    sizes, mixed_tokens, max_bs = {1: [1, 2, 4, 8]}, (64, 128, 256, 512), 8
    graph_for, _plain_for, _mixed_for = GraphRunner.graph_for, GraphRunner._plain_for, GraphRunner._mixed_for

    def __init__(self, runner):
        self.runner, self.replays, self.mixed_replays = runner, 0, 0

    def replay(self, key, step, pending):
        self.replays += 1
        self.mixed_replays += key[0] == 0
        assert not step.prompt_rows, "a step with prompt rows replayed a graph"
        self.runner.graphs = None
        try:
            result = self.runner._model_step(step, ())
        finally:
            self.runner.graphs = self
        return result.logits, None, None


def test_a_step_with_prompt_rows_replays_no_graph(prompts):
    """Chunked prompts (a small budget): steps with the first prompts' chunks take mixed graphs, those with the
    last one's (it wants prompt logprobs) run eagerly; tokens and logprobs are those of a run without graphs."""
    llm = make_llm(default_model_path(), speculative_algorithm="none", max_num_batched_tokens=24,
                   enable_prefix_caching=False)
    ids = [[t % 4096 for t in p] for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2 if i == len(ids) - 1 else None)
              for i in range(len(ids))]
    want = llm.generate(ids, params)
    runner = llm.engine.runner
    runner.graphs = EagerGraphs(runner)
    got = llm.generate(ids, params)
    assert runner.graphs.mixed_replays > 0 and runner.graphs.replays > runner.graphs.mixed_replays
    assert [(o.token_ids, o.prompt_logprobs) for o in got] == [(o.token_ids, o.prompt_logprobs) for o in want]
    assert len(got[-1].prompt_logprobs) == len(ids[-1])
