"""Structured output: a request's grammar (xgrammar) as a token mask, in plain sampling and at every draft
node of a verify.

A request with `SamplingParams.guided` holds a `Grammar`: an xgrammar matcher that every token the request
commits advances (`Sequence.append_tokens`). A plain step masks the logits with the matcher's next-token
mask. A verify masks the logits after each draft node with the mask after that node's path, found by a
depth-first walk of the tree (accept a child's token, visit it, roll back), so the committed state never
sees a draft. A draft the grammar refuses has probability 0 under its parent's masked distribution, so
it is rejected (greedy, seeded or sampled alike) and the rows below it are left unmasked (never used).
Masked logits are -inf, after the penalties and before temperature and the filters: sampling draws from
the constrained distribution with or without speculation.

xgrammar is imported only when a request asks for a grammar (the engine runs without it). Overlap
scheduling: a grammar row's mask needs the previous step's token on the host, so a step that samples for
a grammar request whose last token is still on the device reads it first (one device sync; requests
without a grammar are unaffected when no grammar request is in the batch).
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

import torch

from ..device import to_device

_COMPILERS: dict = {}  # id(tokenizer) -> (tokenizer, xgrammar.GrammarCompiler, bitmask width)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("invalid sampling parameter: structured output needs xgrammar "
                         "(pip install 'specserve[grammar]')") from e
    return xgrammar


def _compiler(tokenizer):
    """The grammar compiler of a Hugging Face tokenizer (one per tokenizer; it caches compiled grammars)."""
    entry = _COMPILERS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        xgr = _xgrammar()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer)
        entry = (tokenizer, xgr.GrammarCompiler(info), xgr.get_bitmask_shape(1, info.vocab_size)[1])
        _COMPILERS[id(tokenizer)] = entry
    return entry


class Grammar:
    """A request's matcher, compiled from its `StructuredOutputsParams`: a JSON schema with compact whitespace
    (", " and ": " separators) and xgrammar's strict mode (no properties or items the schema does not name);
    any JSON object; a regex; a choice among strings (a grammar of their alternatives); an EBNF grammar.
    stop_ids: the tokens that end the request (EOS), which the grammar allows once complete."""

    def __init__(self, params, tokenizer, stop_ids: Sequence[int]):
        xgr = _xgrammar()
        _, compiler, self.width = _compiler(tokenizer)
        spec = params.structured_outputs
        try:
            compiled = _compile(compiler, spec)
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError for what it cannot use
            raise ValueError(f"invalid sampling parameter: structured_outputs.{spec.kind}: {e}") from e
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids) or None)

    def accept(self, token: int) -> bool:
        """Advance by a committed token; False when the grammar refuses it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, pending: Optional[int] = None) -> None:
        """bitmask[row] ([W] int32, on the CPU) = the mask of the next token, after `pending` (the in-flight
        token, not committed yet) when given; left as it is (all ones) when the grammar has ended."""
        if pending is not None and not self.matcher.accept_token(pending):
            return  # the pending token ends the request (or is refused): this row is never used
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if pending is not None:
            self.matcher.rollback(1)

    def fill_tree(self, bitmask: torch.Tensor, tokens: list[int], parents: list[int]) -> None:
        """bitmask [N, W] (CPU, all ones) row j = the mask after draft node j's path, for the tree tokens,
        parents [N]; nodes below a draft the grammar refuses keep all ones."""
        children: list[list[int]] = [[] for _ in tokens]
        for j in range(1, len(tokens)):
            children[parents[j]].append(j)

        def visit(node: int) -> None:
            if not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(bitmask, node)
            for child in children[node]:
                if self.matcher.accept_token(tokens[child]):
                    visit(child)
                    self.matcher.rollback(1)

        visit(0)


def _compile(compiler, spec):
    kind = spec.kind
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return compiler.compile_json_schema(schema, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":  # EBNF string literals take JSON's escapes
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in spec.choice))
    return compiler.compile_grammar(spec.grammar)


def make_grammar(params, detokenizer, stop_ids: Sequence[int]) -> Optional[Grammar]:
    """The Grammar of a request that asks for one (None otherwise). Raises ValueError for an unusable
    schema or a model folder without a tokenizer."""
    if not params.guided:
        return None
    if detokenizer is None:
        raise ValueError("invalid sampling parameter: structured output needs a model folder with a tokenizer")
    return Grammar(params, detokenizer.tokenizer, stop_ids)


def unpack(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] bool: token x allowed iff bit x % 32 of word x // 32 of bitmask [R, W] int32 is set
    (tokens past W * 32, a model's padding beyond the tokenizer, are not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device)[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.flatten(1).bool()[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])], 1)
    return allowed


def guided_rows(seqs: Sequence) -> list[int]:
    return [i for i, s in enumerate(seqs) if s.grammar is not None]


def mask_logits(logits: torch.Tensor, seqs: Sequence, pending: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [len(seqs), V] with the tokens each grammar request's next token cannot be set to -inf (a new
    tensor; the same one when no request has a grammar). pending: as in `process_logits`."""
    rows = guided_rows(seqs)
    if not rows:
        return logits
    width = seqs[rows[0]].grammar.width
    bitmask = torch.full((len(rows), width), -1, dtype=torch.int32)  # [R, W] on the CPU
    waiting = {i: seqs[i].pending_row for i in rows if seqs[i].num_pending}
    tokens = dict(zip(waiting, pending[to_device(list(waiting.values()), torch.long, pending.device)].tolist())) \
        if waiting else {}  # one sync: the in-flight step's tokens of these rows
    for k, i in enumerate(rows):
        seqs[i].grammar.fill(bitmask, k, tokens.get(i))
    index = to_device(rows, torch.long, logits.device)
    allowed = unpack(bitmask, logits.shape[-1], logits.device)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))


def mask_tree_logits(logits: torch.Tensor, seqs: Sequence, trees: Sequence) -> torch.Tensor:
    """logits [B, N, V] after each node of the step's draft trees, masked for the grammar requests by the
    mask after each node's path (a new tensor; the same one when no request has a grammar)."""
    rows = guided_rows(seqs)
    if not rows:
        return logits
    b, n, v = logits.shape
    width = seqs[rows[0]].grammar.width
    bitmask = torch.full((len(rows), n, width), -1, dtype=torch.int32)  # [R, N, W] on the CPU
    for k, i in enumerate(rows):
        seqs[i].grammar.fill_tree(bitmask[k], trees[i].host_tokens(), trees[i].parents)
    index = to_device(rows, torch.long, logits.device)
    allowed = unpack(bitmask.view(len(rows) * n, width), v, logits.device).view(len(rows), n, v)
    return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))
