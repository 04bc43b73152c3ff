"""Sampling: seeds reproduce, and the empirical distribution matches the one asked for."""
from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams

from .conftest import assert_pool_full, make_llm, mixed_prompts
from .stats import chi_square_pvalue, reference_distribution

N = 3000
PROMPT = [5, 17, 99, 3, 42]


@pytest.fixture(scope="module")
def llm(hf_models):
    return make_llm(hf_models["llama"], max_num_seqs=512, max_num_batched_tokens=4096)


@pytest.fixture(scope="module")
def next_token_logits(hf_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


def first_token_counts(llm, params: SamplingParams) -> torch.Tensor:
    outs = llm.generate([PROMPT] * N, params)
    return torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=256).double()


CASES = [
    dict(temperature=0.8),
    dict(temperature=1.3, top_k=12),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_distribution_matches(llm, next_token_logits, case):
    # each case's draws independent of the cases before it: unseeded rows draw from the engine's generator
    llm.engine.runner.generator.manual_seed(100 + CASES.index(case))
    counts = first_token_counts(llm, SamplingParams(max_tokens=1, ignore_eos=True, **case))
    want = reference_distribution(next_token_logits, **case)
    assert chi_square_pvalue(counts, want) > 1e-3
    # the test has power: a sampler that ignored the temperature (or the filters) would fail it
    wrong = reference_distribution(next_token_logits, temperature=case["temperature"] * 1.5)
    assert chi_square_pvalue(counts, wrong) < 1e-6
    assert_pool_full(llm)


def test_seed_reproduces(llm):
    prompts = mixed_prompts(6, 256, seed=4)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(6)]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    # the same seeds, in another batch composition and order, give the same tokens
    again = [o.token_ids for o in llm.generate(prompts[::-1] + prompts[:2], params[::-1] + params[:2])]
    assert again[:6][::-1] == first and again[6:] == first[:2]
    other = [o.token_ids for o in llm.generate(prompts, [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24,
                                                                        ignore_eos=True) for i in range(6)])]
    assert other != first
    assert_pool_full(llm)


def test_logprobs(llm, next_token_logits):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0]
    ref = torch.log_softmax(next_token_logits.double(), -1)
    lp = out.logprobs[0]
    assert out.token_ids[0] == int(ref.argmax())
    assert abs(lp.logprob - ref.max().item()) < 1e-4
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token(llm):
    """vLLM's rule: a temperature below 1e-5 is greedy (1e-300 used to underflow to 0 in float32, making
    the logits inf / NaN and the sample an arbitrary token); top_p 1e-300 (0 in float32) keeps the most
    likely token rather than none. Logits [1, 3, 2]: token 1 every time, seeded or not."""
    from specserve.layers.sampler import Sampler, filtered_logits

    logits = torch.tensor([[1.0, 3.0, 2.0]]).repeat(64, 1)
    for params in (SamplingParams(temperature=1e-300), SamplingParams(temperature=9e-6),
                   SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=1e-300, top_p=1e-300),
                   SamplingParams(temperature=1.0, top_p=1e-300, seed=7)):
        rows = [params] * 64
        assert Sampler()(logits, rows, positions=list(range(64))).tolist() == [1] * 64, params
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-5).greedy
    kept = filtered_logits(logits[:1], [SamplingParams(top_p=1e-300)])
    assert torch.isfinite(kept).tolist() == [[False, True, False]]
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    for params in (dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-300), dict(temperature=1e-300, seed=3)):
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, **params))[0]
        assert out.token_ids == want, params
