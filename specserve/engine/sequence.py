"""A request as the engine sees it: tokens, KV progress, stop conditions."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..layers.grammar import make_grammar
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from ..speculative.tree import DraftTree


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """Log-probability of a sampled token, and the top alternatives the request asked for (best first); a
    prompt token's also has its rank in the distribution (1: the most likely)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: Optional[int] = None


@dataclass(frozen=True)
class RequestOptions:
    """How a request runs besides its sampling: the LoRA adapter it runs with (its name; None: the base model),
    its priority under the priority scheduling policy (lower runs first, as in vLLM), and a cache salt: requests
    share cached KV blocks only with requests of the same salt (vLLM's `cache_salt`, against prompt guessing
    between users)."""

    lora: Optional[str] = None
    priority: int = 0
    cache_salt: Optional[str] = None


class Sequence:
    """One request.

    `token_ids` holds the prompt and every accepted output token. `num_computed_tokens` counts the
    tokens whose KV is in the cache; the rest (usually one, the last sampled token) is computed next
    step. A step may deliver several tokens at once (speculative verify): `append_tokens` applies the
    stop conditions to each in order and keeps only those before the stop.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], max_model_len: int, detokenizer: IncrementalDetokenizer | None,
                 lora: int = 0, cache_salt: Optional[bytes] = None, priority: int = 0, arrival: int = 0):
        """lora: the adapter slot its model runs with (0: the base model); cache_salt: what its prefix-cache
        hashes start from (requests with different salts share no KV: an adapter's differ from the base's);
        priority, arrival: its place in the queues under the priority policy (lower first, then earlier)."""
        self.request_id = request_id
        self.params = params
        self.lora = lora
        self.cache_salt = cache_salt
        self.priority = priority
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.logprobs: list[TokenLogprob] = []
        # with params.prompt_logprobs: per prompt token computed so far, its logprob (None for the first)
        self.prompt_logprobs: list[Optional[TokenLogprob]] = [] if params.prompt_logprobs is None else [None]
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.max_model_len = max_model_len
        self.detokenizer = detokenizer
        self.text = ""
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache held when it was first admitted
        self.draft_state = None  # the proposer's per-request state (speculative decoding only)
        self.req_index = -1  # while running: its row in per-request device buffers (< max_num_seqs)
        self.num_pending = 0  # tokens sampled on the device, not yet known here (overlap scheduling)
        self.pending_row = -1  # where the pending token sits in the in-flight step's sampled tokens
        self.prefix_state = None  # the block manager's per-request prefix-cache state
        self.logits_state = None  # token counts on the device, for penalties (layers/logits_processors.py)
        self.grammar = make_grammar(params, detokenizer, eos_token_ids)  # structured output (layers/grammar.py)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    # ---- appending and stopping --------------------------------------------------------------
    def append_tokens(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Append tokens in order until one of them stops the request. Returns how many were kept."""
        kept = 0
        for i, token in enumerate(tokens):
            self.token_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            kept += 1
            reason = self._stop_reason(token)
            if reason is not None:
                self.finish(reason)
                break
        return kept

    def _stop_reason(self, token: int) -> Optional[str]:
        if token in self.eos_token_ids or token in self.params.stop_token_ids:
            return "stop"
        if self.grammar is not None and (not self.grammar.accept(token) or self.grammar.terminated):
            return "stop"  # the structured output is complete (or, never expected, the grammar refuses it)
        if self.detokenizer is not None:
            new = self.detokenizer.add(token)
            if new:
                self.text += new
                if self.params.stop and self._truncate_at_stop_string(len(new)):
                    return "stop"
        if self.num_output_tokens >= self.params.max_tokens or len(self.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _truncate_at_stop_string(self, num_new_chars: int) -> bool:
        longest = max(len(s) for s in self.params.stop)
        start = max(0, len(self.text) - num_new_chars - longest + 1)
        hits = [(i, -len(s)) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, minus_length = min(hits)  # the first stop string, the longest of those starting there
        self.text = self.text[:at - minus_length if self.params.include_stop_str_in_output else at]
        return True

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    # ---- streaming ---------------------------------------------------------------------------
    def take_new_output(self) -> tuple[list[int], str]:
        """New token ids and text since the last call. Text that may be the start of a stop string is
        held back until the request finishes or the text moves past it."""
        new_ids = self.token_ids[self.num_prompt_tokens + self.num_emitted_tokens:]
        self.num_emitted_tokens = self.num_output_tokens
        end = len(self.text)
        if not self.finished and self.params.stop:
            end = max(self.num_emitted_chars, end - max(len(s) for s in self.params.stop) + 1)
        new_text = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return new_ids, new_text

    def reset_for_recompute(self) -> None:
        """Preempted: the KV is gone, every token (prompt and output so far) is computed again."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.draft_state = None
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: compute `num_tokens` tokens starting at its computed prefix.

    With a `draft`, the tokens are the draft tree's nodes (root = the sequence's uncomputed token),
    placed at position prefix + depth and attending along the tree.
    """

    seq: Sequence
    num_tokens: int
    draft: Optional["DraftTree"] = None

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence's known tokens, so a new token is sampled?"""
        return self.seq.num_computed_tokens + self.num_tokens >= self.seq.num_tokens
