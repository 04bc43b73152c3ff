"""Per-request sampling options, shaped like vLLM's `SamplingParams`."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Optional, Union

GREEDY_BELOW = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)


class SamplingParamError(ValueError):
    """A sampling parameter out of its range or type; `param`: the field it names first (None: none)."""

    def __init__(self, message: str):
        super().__init__(f"invalid sampling parameter: {message}")
        first = message.split(" ", 1)[0].rstrip(",:")  # "temperature", "structured_outputs.regex", "bad", ...
        self.param = first if first.split(".")[0] in SamplingParams.__dataclass_fields__ else None


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`); exactly one of:
    - `json`: a JSON schema (a dict or its JSON text); properties it does not name are never generated;
    - `json_object`: any JSON object;
    - `regex`: a regular expression the whole output matches (xgrammar's dialect: no lookaround or
      backreferences);
    - `choice`: one of these strings, exactly;
    - `grammar`: a context-free grammar in xgrammar's EBNF (GBNF: `root ::= ...`, string literals in double
      quotes, character classes, `*` `+` `?`), whose `root` rule the output matches.
    """

    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def validate(self, bad) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            bad(f"structured_outputs takes exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        if not isinstance(self.json_object, bool):
            bad(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            bad(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    bad(f"structured_outputs.json is not valid JSON: {e}")
            if not isinstance(schema, (dict, bool)):
                bad(f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}")


KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature below 1e-5 (0 included) is greedy, as in vLLM: smaller ones would scale the logits past
    float32's range. top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable theirs; top_p always keeps
    the most likely token, however small it is.
    `logprobs` asks for the log-probability of each sampled token plus that many top alternatives (0: the sampled
    token only; the engine takes up to its max_logprobs, 20 unless set); `prompt_logprobs` the same for every prompt
    token after the first (of the model's raw distribution; the request then computes its whole prompt, cached
    blocks or not). Stop strings are removed from the returned text (kept with `include_stop_str_in_output`), and
    special tokens (`<|im_end|>`, ...) have no text (they do with `skip_special_tokens` false). `seed` (any integer,
    taken mod 2^64) makes sampling reproducible: the token at each sequence index is a function of the seed, that
    index and the logits only (`layers.sampler.seeded_tokens`), with or without speculation.

    Logits processors, applied before temperature and the filters, in plain sampling and at every draft
    node of a verify alike (`layers.logits_processors`):
    - `repetition_penalty` (> 0, 1 off; vLLM's): the logit of every token seen in the prompt or the
      output so far is divided by it when positive, multiplied by it when negative;
    - `presence_penalty`, `frequency_penalty` (in [-2, 2], 0 off; OpenAI's): subtract presence * [count > 0]
      + frequency * count from each token's logit, counting output tokens only;
    - `logit_bias` ({token id: bias in [-100, 100]}): added to the logits (token ids are checked against
      the vocabulary by the engine);
    - `min_tokens` (<= max_tokens): EOS and `stop_token_ids` cannot be sampled before that many output
      tokens.
    - `allowed_token_ids` (vLLM's; None: all): only these tokens can be sampled (the others' logits -inf).
    - `bad_words` (vLLM's): strings the output never contains as tokenized: each word is tokenized alone and
      after a space (`update_from_tokenizer`, which the engine calls), a one-token word is never sampled, and
      a longer one's last token is not sampled right after the output's last tokens spell the rest of it.

    `structured_outputs` (`StructuredOutputsParams`, vLLM's; through xgrammar: the `grammar` extra) constrains
    the output: only tokens that keep it a prefix of a match can be sampled, and the request stops when the
    match is complete.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    allowed_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    bad_words: list[str] = field(default_factory=list)
    # bad_words as token ids (`update_from_tokenizer`); None: not tokenized
    bad_words_token_ids: Optional[list[list[int]]] = field(default=None, init=False, repr=False, compare=False)
    # the bad_words that bad_words_token_ids were made from (a second update_from_tokenizer reuses them)
    _tokenized_words: Optional[list[str]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif self.bad_words is None or isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _token_keys(self.logit_bias)
        if isinstance(self.allowed_token_ids, (tuple, set, frozenset)):
            self.allowed_token_ids = sorted(self.allowed_token_ids)
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise SamplingParamError(msg)

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                bad(f"{name} must be an integer >= 0, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad(f"bad_words must be a list of strings that are not blank, got {self.bad_words!r}")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty < float("inf"):
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                bad(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.logit_bias, dict):
            bad(f"logit_bias must be a mapping of token ids to numbers, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                bad(f"logit_bias keys must be non-negative token ids, got {token!r}")
            if not _number(bias) or not -100 <= bias <= 100:
                bad(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not allowed or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed)):
            bad(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self._validate_guided(bad)

    def _validate_guided(self, bad) -> None:
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        self.structured_outputs.validate(bad)
        if self.min_tokens:
            bad("min_tokens cannot be combined with structured outputs (the grammar may end sooner)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def check_logprobs(self, limit: int) -> None:
        """Raise ValueError if logprobs or prompt_logprobs asks for more than `limit` top alternatives a token (the
        engine's max_logprobs; the engine calls this where it checks prompts)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise SamplingParamError(f"{name} asks for {value} top log-probabilities a token, more than "
                                         f"max_logprobs, {limit} (--max-logprobs)")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if logit_bias, stop_token_ids, allowed_token_ids or the tokenized bad_words name a token
        outside the vocabulary (the engine calls this where it checks prompts)."""
        words = [t for word in self.bad_words_token_ids or [] for t in word]
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or []), ("bad_words", words)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamError(f"{name} token id {bad[0]} is outside the vocabulary (size {vocab_size})")

    def update_from_tokenizer(self, tokenizer) -> None:
        """Tokenize bad_words into bad_words_token_ids as vLLM does: each word without its leading spaces, and
        after one space where that gives as many tokens with a different first one (the word inside a text).
        ValueError for a word with no tokens, or for bad_words with no tokenizer. Without bad_words it does
        nothing (token ids set directly stay), and nothing again for the same bad_words."""
        if not self.bad_words or self._tokenized_words == self.bad_words:
            return
        if tokenizer is None:
            raise SamplingParamError("bad_words needs the model's tokenizer, and this model folder has none")
        ids = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not alone:
                raise SamplingParamError(f"bad_words: {word!r} tokenizes to no tokens")
            ids.append(list(alone))
            inside = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(inside) == len(alone) and inside[0] != alone[0]:
                ids.append(list(inside))
        self.bad_words_token_ids, self._tokenized_words = ids, list(self.bad_words)

    @property
    def guided(self) -> bool:
        """Is the output constrained by a grammar (`structured_outputs`)?"""
        return self.structured_outputs is not None

    @property
    def has_penalties(self) -> bool:
        """Do the logits depend on the tokens so far (repetition, presence or frequency penalty)?"""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def processes_logits(self) -> bool:
        """Does any logits processor apply (penalties, logit_bias, min_tokens, allowed_token_ids or bad words)?"""
        return self.has_penalties or self.has_bias or self.min_tokens > 0 or self.has_bad_words

    @property
    def has_bad_words(self) -> bool:
        """Are tokens banned after some outputs (bad words, once tokenized)?"""
        return bool(self.bad_words_token_ids)

    @property
    def has_bias(self) -> bool:
        """Is a fixed amount added to logits (logit_bias, or -inf outside allowed_token_ids)?"""
        return bool(self.logit_bias) or self.allowed_token_ids is not None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_keys(bias):
    """logit_bias with keys that spell whole numbers ("50256", as JSON objects carry them) made ints;
    anything else is left for `validate` to name."""
    if not isinstance(bias, dict):
        return bias if bias is not None else {}
    return {int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k: v for k, v in bias.items()}
