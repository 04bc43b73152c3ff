"""Token-exact parity with Hugging Face transformers (greedy, fp32, CPU)."""
from __future__ import annotations

import pytest

from specserve import SamplingParams

from .conftest import ARCHS, DEVICE, assert_pool_full, hf_greedy, make_hf_checkpoint, make_llm, mixed_prompts

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def expected(hf_models):
    prompts = mixed_prompts(8, 256, seed=1)
    return prompts, {arch: hf_greedy(path, prompts, NEW_TOKENS) for arch, path in hf_models.items()}


CASES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kv_blocks": 16, "block_size": 8, "max_model_len": 128},
    "small_batch": {"max_num_seqs": 3, "max_num_batched_tokens": 40},
    "eager": {"enforce_eager": True},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(hf_models, expected, arch, case):
    prompts, want = expected
    llm = make_llm(hf_models[arch], **CASES[case])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.token_ids == want[arch][i], f"{arch}/{case}: prompt {i} differs"
        assert out.finish_reason == "length"
    graphs = llm.engine.runner.graphs
    if DEVICE["name"] == "cuda" and case != "eager":
        assert graphs is not None and graphs.replays > 0, "decode steps should replay CUDA graphs"
        if case in ("chunked_prefill", "small_batch"):  # steps within the smallest budgets: prompt chunks too
            assert graphs.mixed_replays > 0, "steps with prompt chunks should replay mixed graphs"
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
    assert_pool_full(llm)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    path = make_hf_checkpoint(str(tmp_path / "l3"), "llama", seed=5, tie=True, rope_scaling=scaling)
    prompts = mixed_prompts(4, 256, seed=2, lo=20, hi=90)
    want = hf_greedy(path, prompts, 32)
    llm = make_llm(path, max_num_batched_tokens=24)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert_pool_full(llm)


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_hf_checkpoint(str(tmp_path / "one"), "qwen2", seed=7)
    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    import os

    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    prompts = mixed_prompts(3, 256, seed=3)
    want = hf_greedy(src, prompts, 16)
    llm = make_llm(str(tmp_path / "sharded"))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
