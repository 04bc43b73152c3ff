"""Qwen3-MoE and Mixtral: token-exact greedy parity with transformers (fp32, CPU) for tiny random checkpoints
(Qwen3-MoE with routed and dense layers, with and without top-k renormalisation; Mixtral routed in every
layer); the Hub expert layouts load into stacked weights."""
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


def make_mixtral_checkpoint(path: str, seed: int = 0, vocab: int = 256) -> str:
    """Save a tiny random transformers Mixtral model (8 experts, top 2, every layer routed) to `path`."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=48, num_local_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                              sliding_window=None, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
                              initializer_range=0.25)
    model = tf.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    models = {name: make_moe_checkpoint(str(root / name), seed=10 + i, **cfg)
              for i, (name, cfg) in enumerate(MOE_CONFIGS.items())}
    models["mixtral"] = make_mixtral_checkpoint(str(root / "mixtral"), seed=20)
    return models


@pytest.fixture(scope="module")
def expected(moe_models):
    prompts = mixed_prompts(8, 256, seed=1)
    return prompts, {name: hf_greedy(path, prompts, NEW_TOKENS) for name, path in moe_models.items()}


CASES = {name: PARITY_CASES[name] for name in ("plain", "chunked_prefill", "preemption")}


def test_checkpoint_has_hub_layout_and_both_layer_kinds(moe_models):
    from safetensors import safe_open

    from specserve.layers.moe import SparseMoeBlock

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


def test_mixtral_loads_its_hub_layout(moe_models):
    from safetensors import safe_open

    from specserve.layers.moe import SparseMoeBlock

    path = moe_models["mixtral"]
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.2.block_sparse_moe.experts.7.w3.weight",
            "model.layers.0.block_sparse_moe.gate.weight"} <= names  # one tensor per expert, its router
    llm = make_llm(path)
    layers = llm.engine.runner.model.model.layers
    assert all(isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.norm_topk_prob for layer in layers)
    assert layers[0].mlp.experts.w13.shape == (8, 96, 64) and layers[0].mlp.experts.w2.shape == (8, 64, 48)
    assert model_class("MixtralForCausalLM") is type(llm.engine.runner.model)


@pytest.mark.parametrize("config", [*MOE_CONFIGS, "mixtral"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(moe_models, expected, config, case):
    prompts, want = expected
    llm = make_llm(moe_models[config], **CASES[case])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for i, out in enumerate(outs):
        assert out.token_ids == want[config][i], f"{config}/{case}: prompt {i} differs"
        assert out.finish_reason == "length"
    if DEVICE["name"] == "cuda":  # the experts' Triton kernels read nothing on the host: graphs hold them
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
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
@pytest.mark.parametrize("config", ["mlp_only_layers", "mixtral"])
def test_two_ranks_equal_one(moe_models, config):
    path = moe_models[config]
    prompts = mixed_prompts(4, 256, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in make_llm(path).generate(prompts, params)]
    llm = make_llm(path, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.model.layers[0].mlp.experts.w2.shape == (8, 64, 24)  # sharded
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.close()


def test_eagle3_on_a_moe_target_is_lossless(tmp_path):
    """`specserve train-draft` trains a drafter on a tiny Qwen3-MoE target (its aux hidden states are the
    routed layers' residual stream); speculating with it gives plain decoding's tokens and accepts drafts."""
    from transformers import AutoTokenizer

    from specserve.assets import default_model_path
    from specserve.cli import main
    from specserve.train.data import pack_rows

    from .test_train_draft import ARGS, TEXT

    src = default_model_path()
    vocab = json.load(open(os.path.join(src, "config.json")))["vocab_size"]
    target = make_moe_checkpoint(str(tmp_path / "target"), seed=5, vocab=vocab, num_hidden_layers=4,
                                 mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), target)
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    out = str(tmp_path / "draft")
    assert main(["train-draft", "--target", target, "--data", str(data), "--out", out, "--steps", "40",
                 *ARGS]) == 0
    ids = AutoTokenizer.from_pretrained(target).encode(TEXT, add_special_tokens=False)
    prompts = pack_rows([ids], 32, None)[:4, :4].tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in make_llm(target).generate(prompts, params)]
    for topk, tokens in ((1, None), (2, 6)):  # a chain and a tree
        llm = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=out,
                       speculative_num_steps=3, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                       speculative_policy="always")
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.stats.spec.mean_acceptance_length > 1.5
        assert_pool_full(llm)


def test_a_sliding_window_bounds_the_context(moe_models, tmp_path):
    """Sliding-window attention is not implemented: a checkpoint whose window is shorter than its positions
    (Mistral v0.1, some Mixtral configs) serves contexts up to the window, and a longer max_model_len is an
    error naming it, instead of silently attending past the window."""
    from specserve.config import ConfigError, EngineConfig
    from specserve.engine.machine import resolve_config

    path = str(tmp_path / "windowed")
    shutil.copytree(moe_models["mixtral"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 128
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert resolve_config(EngineConfig.from_options(model=path, device="cpu")).model.max_model_len == 128
    with pytest.raises(ConfigError, match="sliding_window"):
        resolve_config(EngineConfig.from_options(model=path, device="cpu", max_model_len=256))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_gemm", "loop"])
def test_grouped_linear_matches_per_expert_linears(grouped):
    """Rows sorted by expert through one grouped GEMM (or, where torch has none for the device and dtype,
    the loop) equal each expert's own linear, empty groups included."""
    from specserve.layers import moe

    dev = torch.device(DEVICE["name"])
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 24, 32, generator=g).to(dev)  # [experts, out, in]
    counts = [3, 0, 7, 1, 0]
    x = torch.randn(sum(counts), 32, generator=g).to(dev)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32).to(dev)
    key = (dev.type, x.dtype)
    skipped = key in moe._GROUPED_FAILS
    if not grouped:
        moe._GROUPED_FAILS.add(key)
    try:
        got = moe.grouped_linear(x, w, ends)
    finally:
        if not grouped and not skipped:
            moe._GROUPED_FAILS.discard(key)
    want = torch.cat([torch.nn.functional.linear(x[s:e], w[i]) for i, (s, e) in
                      enumerate(zip([0, *ends[:-1].tolist()], ends.tolist()))])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if grouped and DEVICE["name"] == "cpu":
        assert key not in moe._GROUPED_FAILS  # torch's grouped GEMM ran (no fallback) on this CPU build
