"""Incremental detokenization: text grows as tokens arrive, without re-decoding the whole output."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text.

    Byte-level BPE tokens can end inside a multi-byte character; such a tail decodes to U+FFFD and is
    held back until the next token completes it. A short window of earlier tokens is re-decoded with the
    new ones so that tokenizers that merge spaces across tokens produce the same text as a full decode.
    """

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, window: int = 6):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-window:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it adds (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new
