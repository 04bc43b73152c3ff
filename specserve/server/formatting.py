"""Response bodies and stream chunks: what both generation endpoints share."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from ..engine.outputs import RequestOutput
from ..engine.sequence import TokenLogprob


def sse(obj) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # what a logprob of -inf (or NaN) is sent as, as vLLM does: JSON has no infinities


def json_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: Optional[int] = None) -> dict:
    """OpenAI's usage; with num_cached_tokens, its `prompt_tokens_details` too."""
    out = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
           "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


def new_logprobs(out: RequestOutput) -> list[tuple[int, TokenLogprob]]:
    """(token id, logprob) of the tokens this output added. `out.logprobs` is the request's live list,
    so it is sliced by position, never taken whole."""
    end = out.num_output_tokens
    start = end - len(out.new_token_ids)
    return list(zip(out.new_token_ids, out.logprobs[start:end]))


class TokenText:
    """Each token's own text (for logprobs), decoded once and cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one response repeats: its id, the model name, its creation time."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


class Formatter:
    """Turns the outputs of one choice (`index`) of a response into an endpoint's OpenAI bodies. Subclasses
    fill in the choices."""

    object = ""  # the non-streamed body's "object"
    chunk_object = ""  # a streamed chunk's "object"

    def __init__(self, envelope: Envelope, token_text: TokenText, logprobs: bool, index: int = 0):
        self.envelope = envelope
        self.token_text = token_text
        self.logprobs = logprobs
        self.index = index

    # ---- streamed -------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        return []

    def chunk(self, out: RequestOutput) -> Optional[dict]:
        """The chunk for one output, or None when it adds nothing to send yet."""
        raise NotImplementedError

    def end_chunk(self, finish_reason: str) -> dict:
        """A last chunk with no new content, ending the choice (used when the server aborts)."""
        raise NotImplementedError

    def usage_chunk(self, total: dict) -> dict:
        """The chunk after the last choice's: no choices, the usage of the whole response."""
        return dict(self.envelope.wrap(self.chunk_object, []), usage=total)

    # ---- not streamed ---------------------------------------------------------------------------
    def choice(self, out: RequestOutput) -> dict:
        raise NotImplementedError

    def count(self, out: RequestOutput) -> int:
        """The completion tokens this choice's usage counts."""
        return out.num_output_tokens


def response(formatters: list[Formatter], outs: list[RequestOutput], num_prompt_tokens: int) -> dict:
    """The non-streamed body: one choice per formatter and its finished output; the prompt counts once in
    the usage, the completion tokens of every choice add up."""
    body = formatters[0].envelope.wrap(formatters[0].object, [f.choice(out) for f, out in zip(formatters, outs)])
    body["usage"] = usage(num_prompt_tokens, sum(f.count(out) for f, out in zip(formatters, outs)))
    return body
