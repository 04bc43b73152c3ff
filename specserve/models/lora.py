"""Loading LoRA adapters saved by PEFT (adapter_config.json and adapter_model.safetensors) into a model's linear
layers (layers/lora.py computes with them).

Adapters on the attention and dense MLP projections (q/k/v/o, gate/up/down) load; PEFT's options that change
what an adapter is beyond those (DoRA, biases, extra saved modules, per-layer ranks or alphas, layers chosen by
index) are refused by name, as are targets elsewhere (embeddings, the LM head, experts).
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict

import torch
from torch import nn

from ..layers.linear import LinearBase, RowParallelLinear

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."
# adapter_config.json options that must keep their neutral value: (name, the values allowed)
NEUTRAL = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
           "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "layers_to_transform": (None, []),
           "fan_in_fan_out": (False, None), "lora_bias": (False, None)}
NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(\.default)?\.weight$")
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the layers adapters may target (fused names)


class LoRAError(ValueError):
    pass


def read_adapter(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """An adapter folder's config and tensors (safetensors, or a .bin read with weights_only)."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise LoRAError(f"{folder!r} is not a LoRA adapter: it has no {CONFIG}")
    with open(path) as f:
        config = json.load(f)
    for name, allowed in NEUTRAL.items():
        if config.get(name) not in allowed:
            raise LoRAError(f"{folder}: {CONFIG} sets {name}={config[name]!r}, which specserve does not support")
    files = [os.path.join(folder, w) for w in WEIGHTS if os.path.isfile(os.path.join(folder, w))]
    if not files:
        raise LoRAError(f"{folder!r} has no {' or '.join(WEIGHTS)}")
    if files[0].endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(files[0])
    else:
        tensors = torch.load(files[0], map_location="cpu", weights_only=True)
    return config, tensors


def adapter_scale(config: dict, rank: int) -> float:
    alpha = config.get("lora_alpha", rank)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def reserve(model: nn.Module, slots: int, rank: int) -> None:
    """Room in every layer adapters may target for `slots` adapters of rank up to `rank`."""
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name.rsplit(".", 1)[-1] in TARGETS:
            module.reserve_lora(slots, rank)


def clear(model: nn.Module, slot: int) -> None:
    """Remove the adapter in `slot` from every layer."""
    for module in model.modules():
        if isinstance(module, LinearBase) and module.lora is not None:
            module.lora.clear(slot)


def load_adapter(model: nn.Module, folder: str, slot: int, max_rank: int) -> None:
    """Put the adapter in `folder` into the model's layers as slot `slot`, sharded as each layer is (room
    reserved: `reserve`)."""
    config, tensors = read_adapter(folder)
    parts: dict[str, dict] = defaultdict(dict)  # our module -> shard id -> {"A": .., "B": ..}
    packed = model.packed_modules
    for name, tensor in tensors.items():
        match = NAME.match(name.removeprefix(PREFIX))
        if match is None:
            raise LoRAError(f"{folder}: tensor {name} is not a LoRA matrix of a linear layer (lora_A / lora_B)")
        module, which = match["module"], match["which"]
        leaf = module.rsplit(".", 1)[-1]
        ours, shard = packed.get(leaf, (leaf, None))
        parts[module[:len(module) - len(leaf)] + ours][shard, which] = tensor
    if not parts:
        raise LoRAError(f"{folder}: the adapter holds no LoRA matrices")
    weights = {}  # every layer's first, so that an adapter that fails to load leaves none of its matrices behind
    for module, matrices in parts.items():
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            layer = None
        if not isinstance(layer, LinearBase) or layer.lora is None:
            raise LoRAError(f"{folder}: LoRA on {module} is not supported (only the attention and dense MLP "
                            f"projections of this model)")
        weights[layer] = _layer_weights(layer, matrices, config, folder, module, max_rank)
    for layer, (a, b) in weights.items():
        layer.lora.put(slot, a, b)


def _layer_weights(layer: LinearBase, matrices: dict, config: dict, folder: str, module: str, max_rank: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's A [rank, in] and B [out, rank] for this rank: the targeted parts' A stacked, each part's B in its
    rows (B scaled)."""
    shards = sorted({shard for shard, _ in matrices}, key=str)
    weight = layer.weight
    a_parts, b_parts = [], []
    for shard in shards:
        a, b = matrices.get((shard, "A")), matrices.get((shard, "B"))
        if a is None or b is None or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{folder}: {module} ({shard or 'whole'}) needs lora_A [r, in] and lora_B [out, r]")
        if a.shape[0] > max_rank:
            raise LoRAError(f"{folder}: {module} has rank {a.shape[0]}, more than max_lora_rank {max_rank}")
        a_parts.append(a.to(weight.dtype))
        b_parts.append(b.to(weight.dtype) * adapter_scale(config, a.shape[0]))
    rank = sum(a.shape[0] for a in a_parts)
    row_parallel = isinstance(layer, RowParallelLinear)
    a_local = torch.zeros(rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
    b_local = torch.zeros(weight.shape[0], rank, dtype=weight.dtype, device=weight.device)
    col = 0
    try:
        for shard, a, b in zip(shards, a_parts, b_parts):
            r = a.shape[0]
            if row_parallel:  # A by columns as the weight; B whole
                layer.load(a_local[col:col + r], a)
                b_local[:, col:col + r] = b
            else:  # B by rows as the weight (into its part's rows of a fused layer); A whole
                a_local[col:col + r] = a
                target = b_local[:, col:col + r]
                layer.load(target, b) if shard is None else layer.load(target, b, shard)
            col += r
    except (ValueError, RuntimeError) as e:
        raise LoRAError(f"{folder}: {module}: {e}") from None
    return a_local, b_local


def random_adapter(path: str, base: str, targets: tuple[str, ...], rank: int, seed: int, scale: float = 0.3,
                   **config) -> str:
    """Write a random PEFT adapter for the model folder `base` to `path` (tests and benchmarks, as checkpoint.py
    writes models for them): lora_A and lora_B on the projections named in `targets` (q_proj, ..., down_proj)
    of every layer, B non-zero unlike PEFT's initialization, lora_alpha 2 * rank; `config` adds to
    adapter_config.json. Returns path."""
    from safetensors.torch import save_file

    from .loader import iterate_tensors

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in iterate_tensors(base):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out, inp = w.shape
            tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * scale
            tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * scale
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS[0]))
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "bias": "none", "base_model_name_or_path": base, **config}, f)
    return path
