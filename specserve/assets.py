"""Where the default model lives.

The package ships a trained target (and its EAGLE-3 drafter) under `assets/default/` once they exist.
Until then the default is a tiny random Llama with a byte-level BPE tokenizer that specserve builds
itself on first use, under ~/.cache/specserve: it exercises every code path but writes gibberish.
"""
from __future__ import annotations

import json
import os
import tempfile

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
SHIPPED_TARGET = os.path.join(ASSETS, "default", "target")
SHIPPED_DRAFT = os.path.join(ASSETS, "default", "eagle3")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def default_model_path() -> str:
    if os.path.isfile(os.path.join(SHIPPED_TARGET, "config.json")):
        return SHIPPED_TARGET
    path = os.path.join(os.path.expanduser("~"), ".cache", "specserve", "tiny-random-llama")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_checkpoint(path)
    return path


def default_draft_path() -> str | None:
    return SHIPPED_DRAFT if os.path.isfile(os.path.join(SHIPPED_DRAFT, "config.json")) else None


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    here = os.path.dirname(__file__)
    files = [os.path.join(root, f) for root, _, fs in os.walk(here) for f in fs if f.endswith(".py")]
    tok.train(sorted(files), trainer)
    return tok


def make_tiny_checkpoint(path: str, vocab_size: int = 512, seed: int = 0) -> None:
    """Write a tiny random Llama checkpoint with a tokenizer to `path` (atomically)."""
    import torch
    from safetensors.torch import save_file

    from .models import ArchConfig
    from .models.llama import LlamaForCausalLM

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path))
    tok = _train_tokenizer(vocab_size)
    tok.save(os.path.join(tmp, "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": True, "eos_token_id": 0, "bos_token_id": 0, "torch_dtype": "float32",
    }
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 1024}, f)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ArchConfig.from_dict(config))
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones_like(p)
        elif name != "lm_head.weight":
            tensors[name] = torch.randn_like(p) * 0.1
    save_file(_unpack(tensors, config), os.path.join(tmp, "model.safetensors"))
    try:
        os.rename(tmp, path)
    except OSError:  # another process made it first
        pass


def _unpack(tensors: dict, config: dict) -> dict:
    """Our fused qkv / gate_up parameters -> Hugging Face's separate tensors."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    out = {}
    for name, t in tensors.items():
        if "qkv_proj" in name:
            q, k, v = t.split([heads * d, kv * d, kv * d])
            for part, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = x.contiguous()
        elif "gate_up_proj" in name:
            g, u = t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = g.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = u.contiguous()
        else:
            out[name] = t.contiguous()
    return out
