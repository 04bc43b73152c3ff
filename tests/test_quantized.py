"""FP8 checkpoints as the Hub publishes them, dequantized as they load: greedy outputs equal transformers' on the
same weights dequantized (block-wise `fp8` as Qwen3-*-FP8, per-channel and per-tensor compressed-tensors as
llm-compressor writes them); other quantization methods are refused by name."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.models import UnsupportedModel

from .conftest import hf_greedy, make_hf_checkpoint, make_llm, mixed_prompts

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, scheme: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w in float8_e4m3fn and its scale(s), largest magnitude of each group to e4m3's 448."""
    if scheme == "block":
        bo, bi = block
        out, inp = w.shape
        scale = torch.zeros(math.ceil(out / bo), math.ceil(inp / bi))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].abs().max() / 448
        full = scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    elif scheme == "channel":
        scale = full = w.abs().amax(dim=1, keepdim=True) / 448
    else:
        scale = full = (w.abs().max() / 448).reshape(1)
    return (w / full).to(torch.float8_e4m3fn), scale


def fp8_checkpoint(base: str, path: str, scheme: str, block=(16, 32)) -> tuple[str, str]:
    """The base model with its projections in FP8 (`path`), and the same weights dequantized (`path`-ref), the
    oracle's copy."""
    weights = load_file(os.path.join(base, "model.safetensors"))
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    quantized, reference = {}, dict(weights)
    for name, w in weights.items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
            q, scale = quantize(w, scheme, block)
            quantized[name] = q
            quantized[name + ("_scale_inv" if scheme == "block" else "_scale")] = scale
            if scheme != "block":
                quantized[name.replace(".weight", ".input_scale")] = torch.ones(1)  # static activations: skipped
            reference[name] = _dequantized(q, scale, scheme, block)
        else:
            quantized[name] = w
    if scheme == "block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                             "strategy": scheme}}}}
    for folder, tensors, cfg in ((path, quantized, config), (path + "-ref", reference, None)):
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg or {k: v for k, v in config.items() if k != "quantization_config"}, f)
    return path, path + "-ref"


def _dequantized(q: torch.Tensor, scale: torch.Tensor, scheme: str, block) -> torch.Tensor:
    """The oracle's own dequantization, one group at a time."""
    w = q.to(torch.float32)
    if scheme != "block":
        return w * scale
    out = torch.empty_like(w)
    bo, bi = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] * scale[i, j]
    return out


@pytest.mark.parametrize("arch,scheme", [("qwen3", "block"), ("llama", "channel"), ("qwen2", "tensor")])
def test_fp8_checkpoints_equal_transformers_on_their_dequantized_weights(tmp_path, arch, scheme):
    base = make_hf_checkpoint(str(tmp_path / "base"), arch, seed=3)
    fp8, ref = fp8_checkpoint(base, str(tmp_path / "fp8"), scheme)
    prompts = mixed_prompts(6, 256, seed=2)
    llm = make_llm(fp8, speculative_algorithm="none")
    from specserve import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(ref, prompts, 32)
    assert [o.token_ids for o in outs] != hf_greedy(base, prompts, 32)  # the quantization shows


def test_other_quantization_methods_are_refused_by_name(tmp_path):
    base = make_hf_checkpoint(str(tmp_path / "base"), "llama", seed=3)
    with open(os.path.join(base, "config.json")) as f:
        config = json.load(f)
    for quant, words in [({"quant_method": "awq", "bits": 4}, "'awq'-quantized checkpoints are not supported"),
                         ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
                         ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
                             "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, "per channel")]:
        with open(os.path.join(base, "config.json"), "w") as f:
            json.dump(dict(config, quantization_config=quant), f)
        with pytest.raises(UnsupportedModel, match=words):
            make_llm(base, speculative_algorithm="none")
