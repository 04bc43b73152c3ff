"""What the engine answers a request with (`RequestOutput`), what a prompt may be, and the errors a request can get."""
from __future__ import annotations

from typing import Optional, Union

from .sequence import Sequence, TokenLogprob

Prompt = Union[str, list[int]]


class RequestError(ValueError):
    """A request is invalid (the message names the problem); nothing else is affected."""


class EngineBusy(RequestError):
    """What was asked needs the engine idle (no request holding KV blocks), and it is not."""


class RequestOutput:
    """What a request produced so far. `new_*` fields hold what arrived since the previous output; `logprobs`
    is the request's live list (read it by position); with SamplingParams.prompt_logprobs, once the prompt is
    computed, `prompt_logprobs` holds per prompt token its logprob (None for the first); `num_cached_tokens`: the
    prompt tokens the prefix cache held when the request was first admitted.

    `prompt_token_ids` and `token_ids` (the output's) are read, when asked for, off the request's token list,
    which only grows: an output keeps what it was when made, and making one copies nothing (a step's outputs
    at batch 256 with 4k-token prompts copied ~4 ms of lists on this project's CPU)."""

    __slots__ = ("request_id", "text", "new_token_ids", "new_text", "finished", "finish_reason", "logprobs",
                 "prompt_logprobs", "num_cached_tokens", "_tokens", "_prompt_len", "_end")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int], text: str,
                 new_token_ids: list[int], new_text: str, finished: bool, finish_reason: Optional[str],
                 logprobs: Optional[list[TokenLogprob]] = None,
                 prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None):
        self.request_id, self.text, self.new_token_ids, self.new_text = request_id, text, new_token_ids, new_text
        self.finished, self.finish_reason = finished, finish_reason
        self.logprobs = [] if logprobs is None else logprobs
        self.prompt_logprobs = prompt_logprobs
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache
        self._tokens = list(prompt_token_ids) + list(token_ids)
        self._prompt_len, self._end = len(prompt_token_ids), len(self._tokens)

    @classmethod
    def of(cls, seq: Sequence, new_token_ids: list[int], new_text: str) -> "RequestOutput":
        """seq's output now, sharing its token list."""
        out = cls.__new__(cls)
        out.request_id, out.text, out.new_token_ids, out.new_text = seq.request_id, seq.text, new_token_ids, new_text
        out.finished, out.finish_reason, out.logprobs = seq.finished, seq.finish_reason, seq.logprobs
        out.prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
        out.num_cached_tokens = seq.num_cached_tokens
        out._tokens, out._prompt_len, out._end = seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids)
        return out

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._tokens[:self._prompt_len]

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[self._prompt_len:self._end]

    @property
    def num_output_tokens(self) -> int:
        return self._end - self._prompt_len

    @property
    def num_prompt_tokens(self) -> int:
        return self._prompt_len

    def __repr__(self) -> str:
        return (f"RequestOutput({self.request_id!r}, text={self.text!r}, tokens={self.num_output_tokens}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")
