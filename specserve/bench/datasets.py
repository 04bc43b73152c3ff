"""Prompt sources for `specserve bench`: the built-in set, ShareGPT JSON, JSONL, and random words.

A dataset is a list of `Prompt`s; `load_dataset("builtin" | "random" | "sharegpt:FILE" | "jsonl:FILE")`
reads one. `Prompt.text` is what the completions endpoint sends, `Prompt.messages` what chat sends.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Optional

from .prompts import BUILTIN_PROMPTS

RANDOM_PROMPTS = 200  # prompts in the `random` dataset
RANDOM_WORDS = (16, 64)  # words per random prompt, inclusive range


@dataclass(frozen=True)
class Prompt:
    text: str
    messages: Optional[tuple[dict, ...]] = None  # None: one user turn with `text`

    def chat_messages(self) -> list[dict]:
        return list(self.messages) if self.messages else [{"role": "user", "content": self.text}]


def builtin() -> list[Prompt]:
    return [Prompt(text) for text in BUILTIN_PROMPTS]


def random_words(seed: int = 0, count: int = RANDOM_PROMPTS) -> list[Prompt]:
    """Prompts of random words drawn from the built-in set's vocabulary (acceptance on these is low:
    benchmark speculation on real text)."""
    vocab = sorted({w for text in BUILTIN_PROMPTS for w in re.findall(r"[A-Za-z_]{2,}", text)})
    rng = random.Random(seed)
    return [Prompt(" ".join(rng.choices(vocab, k=rng.randint(*RANDOM_WORDS)))) for _ in range(count)]


def sharegpt(path: str) -> list[Prompt]:
    """A ShareGPT JSON file: a list of {"conversations": [{"from": "human", "value": ...}, ...]}; each
    conversation's first human turn is a prompt (conversations without one are skipped)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    prompts = []
    for item in data:
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        first = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        if isinstance(first, str) and first.strip():
            prompts.append(Prompt(first))
    return prompts


def jsonl(path: str) -> list[Prompt]:
    """A JSONL file, one {"prompt": "..."} or {"messages": [...]} a line; for the completions endpoint a
    messages line sends its last user message."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            prompts.append(_jsonl_prompt(row, f"{path}:{n}"))
    return prompts


def _jsonl_prompt(row, where: str) -> Prompt:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return Prompt(row["prompt"])
    messages = row.get("messages") if isinstance(row, dict) else None
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        text = users[-1] if users and isinstance(users[-1], str) else str(messages[-1].get("content", ""))
        return Prompt(text, tuple(messages))
    raise ValueError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [...]}}')


def load_dataset(spec: str, seed: int = 0) -> list[Prompt]:
    """The prompts named by `spec`: builtin, random, sharegpt:FILE or jsonl:FILE."""
    kind, _, path = spec.partition(":")
    if kind == "builtin" and not path:
        prompts = builtin()
    elif kind == "random" and not path:
        prompts = random_words(seed)
    elif kind in ("sharegpt", "jsonl") and path:
        prompts = sharegpt(path) if kind == "sharegpt" else jsonl(path)
    else:
        raise ValueError(f"unknown dataset {spec!r}: use builtin, random, sharegpt:FILE or jsonl:FILE")
    if not prompts:
        raise ValueError(f"dataset {spec!r} has no prompts")
    return prompts
