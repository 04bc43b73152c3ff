"""Building a model and filling its weights from a Hugging Face folder, tensor by tensor."""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

from .config import ArchConfig, read_config
from .interface import CausalLM
from .quantization import check_quantization, dequantized
from .registry import model_class

log = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightError(ValueError):
    pass


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise WeightError(f"{index} names {missing[0]}, which does not exist")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise WeightError(f"{folder!r} has no *.safetensors weights")
    return files


def iterate_tensors(folder: str, quantization: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors by name, file by file; with `quantization` (config.json's quantization_config, see
    quantization.py) FP8 weights come dequantized and their scales are consumed."""
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(path, framework="pt")) for path in safetensors_files(folder)]
        tensors = ((name, f.get_tensor(name)) for f in files for name in f.keys())
        if quantization is None:
            yield from tensors
            return
        where = {name: f for f in files for name in f.keys()}
        lookup = lambda name: where[name].get_tensor(name) if name in where else None  # noqa: E731
        yield from dequantized(tensors, lookup, quantization)


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], packed: dict) -> None:
    """Copy each checkpoint tensor into its parameter through the parameter's weight_loader.

    Raises WeightError naming the tensor when one is mis-shaped, and naming the parameters that no
    checkpoint tensor filled. A model's `checkpoint_target(name)` (when it has one) maps the names that
    `packed` cannot, and a parameter's `shard_ids` attribute lists the shards it is filled in.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {(name, shard) for name, p in params.items()
                for shard in getattr(p, "shard_ids", None) or _shards_of(name, packed)}
    loaded: set = set()
    hook = getattr(model, "checkpoint_target", None)
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        target, shard = (hook(name) if hook else None) or (name, None)
        for part, (ours, shard_id) in packed.items():
            if target == name and f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{ours}."), shard_id
                break
        param = params.get(target)
        if param is None:
            log.warning("checkpoint tensor %s has no place in the model; ignored", name)
            continue
        try:
            with torch.no_grad():
                param.weight_loader(param, tensor.to(param.dtype), shard) if shard is not None else \
                    param.weight_loader(param, tensor.to(param.dtype))
        except ValueError as e:
            raise WeightError(f"tensor {name}: {e}") from None
        loaded.add((target, shard))
        if target == "model.embed_tokens.weight" and params.get("lm_head.weight") is param:
            loaded.add(("lm_head.weight", None))
    missing = sorted(f"{n}" + (f" ({s})" if s is not None else "") for n, s in expected - loaded)
    if missing:
        raise WeightError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _shards_of(name: str, packed: dict) -> list:
    shards = [shard for part, (ours, shard) in packed.items() if f".{ours}." in name]
    return shards or [None]


def dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights for benchmarking shapes without a checkpoint, drawn on the weights' device."""
    gens: dict = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                p.normal_(0.0, 0.02, generator=gen)


def build(cls, config, dtype: torch.dtype, device: torch.device, *collaborators):
    """Construct cls(config, *collaborators) with its parameters created directly in dtype on device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config, *collaborators)
    finally:
        torch.set_default_dtype(previous)


def fill_weights(model: nn.Module, folder: str, load_format: str = "safetensors", seed: int = 0) -> None:
    """Fill a built model's parameters in place: from the folder's safetensors (FP8 ones dequantized), or
    dummy weights drawn from seed. WeightError when the checkpoint does not fit the model."""
    if load_format == "dummy":
        dummy_weights(model, seed)
        return
    quantization = check_quantization(read_config(folder).get("quantization_config"))
    load_weights(model, iterate_tensors(folder, quantization), type(model).packed_modules)


def load_model(folder: str, dtype: torch.dtype, device: torch.device, load_format: str = "safetensors",
               seed: int = 0) -> CausalLM:
    """The registered family for the folder's config.json (registry.MODELS), built and filled."""
    arch = ArchConfig.from_dict(read_config(folder))
    check_quantization(arch.raw.get("quantization_config"))  # before the model takes its memory
    model = build(model_class(arch.architecture), arch, dtype, device)
    fill_weights(model, folder, load_format, seed)
    return model.eval()
