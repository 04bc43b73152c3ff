"""The parts of a Hugging Face config.json that the model code needs, and of generation_config.json that
sampling needs, read without transformers."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from .registry import MODELS


class UnsupportedModel(ValueError):
    pass


# architecture -> (q/k/v bias by default, q/k RMSNorm); the families themselves are in registry.MODELS
ARCHITECTURES = {name: (f.qkv_bias, f.qk_norm) for name, f in MODELS.items()}


@dataclass(frozen=True)
class DecoderShape:
    """The shape of a Llama-style decoder layer stack, as config.json states it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int

    @staticmethod
    def fields_from(cfg: dict) -> dict:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        )

    def hf_fields(self) -> dict:
        """These fields under config.json's names (`fields_from` reads them back)."""
        return {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        }


@dataclass(frozen=True)
class ArchConfig(DecoderShape):
    architecture: str
    num_layers: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    raw: dict

    @classmethod
    def from_dict(cls, cfg: dict) -> "ArchConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                                   f"specserve runs {', '.join(ARCHITECTURES)}")
        default_bias, qk_norm = ARCHITECTURES[arch]
        return cls(
            **DecoderShape.fields_from(cfg),
            architecture=arch,
            num_layers=cfg["num_hidden_layers"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", default_bias),
            qk_norm=qk_norm,
            eos_token_ids=_token_ids(cfg.get("eos_token_id")),
            raw=cfg,
        )


def _token_ids(value) -> tuple[int, ...]:
    """An eos_token_id entry (an id, a list of them, or none) as a tuple."""
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


# generation_config.json name -> SamplingParams name, for the sampling defaults vLLM also takes from it
GENERATION_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's generation_config.json asks of generation: more end tokens (Llama 3 instruct models end
    their turns with one config.json does not name), and the sampling a request gets for what it leaves out
    (SamplingParams names)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Optional[str]) -> "GenerationDefaults":
        """From folder's generation_config.json; none without a folder ('vllm') or the file."""
        path = os.path.join(folder, "generation_config.json") if folder not in (None, "vllm") else None
        if path is None or not os.path.isfile(path):
            return cls()
        with open(path) as f:
            cfg = json.load(f)
        sampling = {ours: cfg[theirs] for theirs, ours in GENERATION_SAMPLING.items() if cfg.get(theirs) is not None}
        return cls(_token_ids(cfg.get("eos_token_id")), sampling)


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} has no config.json: not a Hugging Face model folder")
    with open(path) as f:
        return json.load(f)
