"""Qwen3-MoE: token-exact greedy parity with transformers (fp32, CPU) for tiny random checkpoints with routed
and dense layers, with and without top-k renormalisation; the Hub expert layout loads into stacked weights."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from specserve import SamplingParams
from specserve.models import MODELS, WeightError, model_class

from .conftest import DEVICE, assert_pool_full, hf_greedy, make_llm, mixed_prompts
from .test_parity import CASES as PARITY_CASES

NEW_TOKENS = 64

# name -> config overrides: layer 1 dense by mlp_only_layers (renormalised top-k), or layers 0 and 2 dense by
# decoder_sparse_step=2 (raw softmax weights)
MOE_CONFIGS = {
    "mlp_only_layers": dict(num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
    "sparse_step": dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False),
}


def make_moe_checkpoint(path: str, seed: int = 0, vocab: int = 256, **overrides) -> str:
    """Save a tiny random transformers Qwen3-MoE model (8 experts, top 2) to `path`; return path."""
    import transformers as tf

    options = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, moe_intermediate_size=48,
                   num_experts=8, num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, eos_token_id=1, bos_token_id=0, initializer_range=0.25)
    options.update(overrides)
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**options)).eval()
    with torch.no_grad():  # non-trivial norms, like conftest's checkpoints
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: make_moe_checkpoint(str(root / name), seed=10 + i, **cfg)
            for i, (name, cfg) in enumerate(MOE_CONFIGS.items())}


@pytest.fixture(scope="module")
def expected(moe_models):
    prompts = mixed_prompts(8, 256, seed=1)
    return prompts, {name: hf_greedy(path, prompts, NEW_TOKENS) for name, path in moe_models.items()}


CASES = {name: PARITY_CASES[name] for name in ("plain", "chunked_prefill", "preemption")}


def test_checkpoint_has_hub_layout_and_both_layer_kinds(moe_models):
    from safetensors import safe_open

    from specserve.models.qwen3_moe import SparseMoeBlock

    path = moe_models["mlp_only_layers"]
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names  # one tensor per expert
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    llm = make_llm(path)
    layers = llm.engine.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [True, False, True]
    assert layers[0].mlp.experts.w13.shape == (8, 96, 64) and layers[0].mlp.experts.w2.shape == (8, 64, 48)
    assert MODELS["Qwen3MoeForCausalLM"].module == "qwen3_moe"
    assert model_class("Qwen3MoeForCausalLM") is type(llm.engine.runner.model)


@pytest.mark.parametrize("config", list(MOE_CONFIGS))
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(moe_models, expected, config, case):
    prompts, want = expected
    llm = make_llm(moe_models[config], **CASES[case])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.token_ids == want[config][i], f"{config}/{case}: prompt {i} differs"
        assert out.finish_reason == "length"
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the small cache should have forced preemption"
    assert_pool_full(llm)


def test_routing_changes_tokens(moe_models, expected, tmp_path):
    """The experts differ enough that routing matters: the same weights with norm_topk_prob flipped give
    other tokens (so a routing bug would show in the parity tests)."""
    prompts, want = expected
    path = str(tmp_path / "flipped")
    shutil.copytree(moe_models["mlp_only_layers"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["norm_topk_prob"] = not cfg["norm_topk_prob"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = make_llm(path)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert sum(o.token_ids != w[:16] for o, w in zip(outs, want["mlp_only_layers"])) >= 4


def test_missing_expert_is_named(moe_models, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "missing")
    shutil.copytree(moe_models["mlp_only_layers"], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"layers\.2\.mlp\.experts\.w13 \(\(5, 1\)\)"):
        make_llm(path)


@pytest.mark.skipif(not torch.distributed.is_available() or DEVICE["name"] == "cuda",
                    reason="CPU tensor parallelism over gloo")
def test_two_ranks_equal_one(moe_models):
    path = moe_models["mlp_only_layers"]
    prompts = mixed_prompts(4, 256, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in make_llm(path).generate(prompts, params)]
    llm = make_llm(path, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.model.layers[0].mlp.experts.w2.shape == (8, 64, 24)  # sharded
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.close()


def test_moe_models_say_they_run_without_cuda_graphs():
    from specserve.models.llama import LlamaForCausalLM
    from specserve.models.qwen3_moe import Qwen3MoeForCausalLM

    assert LlamaForCausalLM.supports_cuda_graphs and not Qwen3MoeForCausalLM.supports_cuda_graphs
