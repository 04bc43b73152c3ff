"""Quantized checkpoints: FP8 weights, dequantized to the model's dtype as they load.

Two layouts that FP8 releases on the Hub use are read (config.json's `quantization_config`):
- `"quant_method": "fp8"` with `weight_block_size` [bo, bi] (Qwen3-*-FP8, DeepSeek-V3): a float8_e4m3fn `weight`
  [out, in] and a float32 `weight_scale_inv` [ceil(out / bo), ceil(in / bi)], one scale per block; without
  `weight_block_size` one scale for the whole tensor.
- `"quant_method": "compressed-tensors"` with `"format": "float-quantized"` (the FP8 releases made with
  llm-compressor): a float8 `weight` and its `weight_scale`, per output channel ([out, 1]) or per tensor; a static
  `input_scale` is not needed (activations stay in the model's dtype) and is skipped.

The weights then compute in the model's dtype: the checkpoint loads in FP8's place on disk, not in its memory or
speed (no FP8 products yet). Other methods (AWQ, GPTQ, bitsandbytes, ...) are refused by name.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from .config import UnsupportedModel

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # a weight's scale: `<name>_scale_inv` (fp8) or `<name>_scale`
SKIPPED_SUFFIXES = (".input_scale", ".weight_zero_point")


def check_quantization(config: Optional[dict]) -> Optional[dict]:
    """config.json's quantization_config when specserve reads it (None: not quantized); UnsupportedModel
    naming the method otherwise."""
    if not config:
        return None
    method = config.get("quant_method")
    if method == "fp8":
        if config.get("fmt", "e4m3") not in ("e4m3", "e5m2"):
            raise UnsupportedModel(f"fp8 checkpoint in format {config.get('fmt')!r}: specserve reads e4m3 and e5m2")
        return config
    if method == "compressed-tensors":
        if config.get("format") != "float-quantized":
            raise UnsupportedModel(f"compressed-tensors checkpoint in format {config.get('format')!r}: specserve "
                                   "reads float-quantized (FP8) ones only")
        for name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("num_bits") != 8 or weights.get("type") != "float" or \
                    weights.get("strategy") not in ("channel", "tensor"):
                raise UnsupportedModel(f"compressed-tensors group {name!r} quantizes weights as {weights}: specserve "
                                       "reads 8-bit float weights per channel or per tensor")
        return config
    raise UnsupportedModel(f"{method!r}-quantized checkpoints are not supported: specserve loads unquantized ones "
                           "and FP8 ones (quant_method fp8 or compressed-tensors float-quantized)")


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], lookup: Callable[[str], Optional[torch.Tensor]],
                config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP8 weight dequantized (float32) by its scale (`lookup(name)`: a tensor
    of the checkpoint by name, None when there is none); scales and activation scales are consumed."""
    block = config.get("weight_block_size")
    for name, tensor in tensors:
        if name.endswith(SKIPPED_SUFFIXES) or (name.endswith(SCALE_SUFFIXES) and tensor.dtype not in FP8):
            continue
        if tensor.dtype not in FP8:
            yield name, tensor
            continue
        scale = next((s for s in (lookup(name + suffix) for suffix in SCALE_SUFFIXES) if s is not None), None)
        if scale is None:
            raise UnsupportedModel(f"FP8 tensor {name} has no scale ({name}_scale_inv or {name}_scale)")
        yield name, dequantize(tensor, scale, block)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: Optional[list[int]] = None) -> torch.Tensor:
    """weight [out, in] in FP8 times its scale: one per [block[0], block[1]] tile, per row ([out, 1]) or one."""
    w = weight.to(torch.float32)
    scale = scale.to(torch.float32)
    if block is not None and scale.dim() == 2:
        bo, bi = block
        scale = scale.repeat_interleave(bo, dim=0)[:w.shape[0]].repeat_interleave(bi, dim=1)[:, :w.shape[1]]
    return w * scale
