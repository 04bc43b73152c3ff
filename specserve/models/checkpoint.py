"""Writing Hugging Face model folders: the one writer behind the tiny default model (`assets`), `specserve
train-draft` (EAGLE-3 drafts) and the tests' hand-made checkpoints; `loader` reads what it writes.

A folder is config.json, the tensors under Hugging Face's names in model.safetensors (or pytorch_model.bin)
and, when given, tokenizer.json and tokenizer_config.json. Tensors may come under our fused names
(`qkv_proj`, `gate_up_proj`, as `packed_modules` maps them): they are split into q/k/v and gate/up.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Optional

import torch

from .config import DecoderShape

WEIGHT_FILES = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


def hf_tensors(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Our fused q/k/v and gate/up parameters split into Hugging Face's separate tensors (head counts and
    head size from config.json's fields); every tensor made contiguous, the others under their own names."""
    shape = DecoderShape.fields_from(config)
    d, heads, kv = shape["head_dim"], shape["num_heads"], shape["num_kv_heads"]
    out = {}
    for name, t in tensors.items():
        if "qkv_proj" in name:
            q, k, v = t.split([heads * d, kv * d, kv * d])
            for part, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = x.contiguous()
        elif "gate_up_proj" in name:
            gate, up = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save_checkpoint(path: str, config: dict, tensors: dict[str, torch.Tensor], *, fmt: str = "safetensors",
                    tokenizer: Any = None, tokenizer_config: Optional[dict] = None, atomic: bool = False) -> str:
    """Write the Hugging Face folder `path` and return it: config.json, `tensors` (see `hf_tensors`) in
    WEIGHT_FILES[fmt], and with `tokenizer` (a `tokenizers.Tokenizer`) its tokenizer.json, with
    `tokenizer_config` its tokenizer_config.json. atomic: build the folder beside `path` and rename it into
    place, so a reader never sees half a folder; when another process made `path` first, theirs stays."""
    if fmt not in WEIGHT_FILES:
        raise ValueError(f"unknown checkpoint format {fmt!r}; one of {', '.join(WEIGHT_FILES)}")
    if not atomic:
        os.makedirs(path, exist_ok=True)
        _write(path, config, tensors, fmt, tokenizer, tokenizer_config)
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent)
    try:
        _write(tmp, config, tensors, fmt, tokenizer, tokenizer_config)
        os.rename(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        made_first = isinstance(e, OSError) and os.path.isfile(os.path.join(path, "config.json"))
        if not made_first:  # by another process: theirs stays
            raise
    return path


def _write(folder: str, config: dict, tensors: dict[str, torch.Tensor], fmt: str, tokenizer: Any,
           tokenizer_config: Optional[dict]) -> None:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer is not None:
        tokenizer.save(os.path.join(folder, "tokenizer.json"))
    if tokenizer_config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f, indent=2)
    weights = os.path.join(folder, WEIGHT_FILES[fmt])
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(hf_tensors(tensors, config), weights)
    else:
        torch.save(hf_tensors(tensors, config), weights)
