"""Incremental detokenization: text grows as tokens arrive, without re-decoding the whole output."""
from __future__ import annotations

from typing import Optional

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's state broken by non-monotonic output: start afresh


def stream_backend(tokenizer):
    """The Rust `tokenizers.Tokenizer` whose decode is all of `tokenizer.decode(ids, skip_special_tokens=True)`: a
    fast tokenizer that cleans up no spaces after it. None otherwise (a slow tokenizer, or that clean-up)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if DecodeStream is None or backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text.

    Byte-level BPE tokens can end inside a multi-byte character; such a tail is held back until the next
    token completes it. The prompt's last `window` tokens are context, so that a tokenizer that merges or
    strips spaces at the start of a decode continues the prompt as a full decode would.

    A tokenizer whose decode is its Rust backend's alone (`stream_backend`) decodes through `tokenizers`'
    DecodeStream, as vLLM does: one call of ~1 us a token. Others re-decode a window of the last tokens
    twice a token through `tokenizer.decode` (~7 us a token with transformers' wrapper on the CPU; on the
    H200's host at 30 requests a step, the wrapper took ~30% of a plain engine's host time).
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, window: int = 6,
                 skip_special_tokens: bool = True):
        tail = list(prompt_ids[-window:]) if prompt_ids else []  # the prompt's last tokens: context
        self.tokenizer = tokenizer
        self.text = ""
        self.skip_special_tokens = skip_special_tokens
        self._backend = stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        # the window path's state: ids re-decoded from prefix_offset, text emitted up to read_offset
        self.ids: list[int] = [] if self._stream is not None else tail
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        if self._stream is not None:
            for token_id in tail:  # their text is not emitted
                self._step(token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int) -> Optional[str]:
        try:
            return self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):  # an id past what the backend can hold: no text
            return None
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it adds (possibly empty)."""
        if self._stream is not None:
            new = self._step(token_id) or ""
        else:
            new = self._add_window(token_id)
        self.text += new
        return new

    def _add_window(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
