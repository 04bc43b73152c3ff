"""Where the default model lives.

The package ships a trained target (and its EAGLE-3 drafter) under `assets/default/` once they exist.
Until then the default is a tiny random Llama with a byte-level BPE tokenizer that specserve builds
itself on first use, under ~/.cache/specserve: it exercises every code path but writes gibberish.
"""
from __future__ import annotations

import os

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


def _tokenizer(vocab_size: int):
    """The shipped target's tokenizer, so that a tiny checkpoint is the same model whatever the package's code (a
    tokenizer trained on the package's own files changed with every edit, and with it every tiny model's outputs);
    a byte-level BPE of vocab_size trained on the package's files where no target is shipped."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    shipped = os.path.join(SHIPPED_TARGET, "tokenizer.json")
    if os.path.isfile(shipped):
        return Tokenizer.from_file(shipped)

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
    """Write a tiny random Llama checkpoint with a tokenizer (`_tokenizer`) to `path` (atomically)."""
    import torch

    from .models import ArchConfig
    from .models.checkpoint import save_checkpoint
    from .models.llama import LlamaForCausalLM

    tok = _tokenizer(vocab_size)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": True, "eos_token_id": 0, "bos_token_id": 0, "torch_dtype": "float32",
    }
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ArchConfig.from_dict(config))
    tensors = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones_like(p)
        elif name != "lm_head.weight":
            tensors[name] = torch.randn_like(p) * 0.1
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 1024}
    save_checkpoint(path, config, tensors, tokenizer=tok, tokenizer_config=tokenizer_config, atomic=True)
