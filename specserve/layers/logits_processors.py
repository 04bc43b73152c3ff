"""Logits processors that depend on a request's tokens so far: logit_bias, allowed_token_ids, bad words, min_tokens
and the repetition, frequency and presence penalties (`SamplingParams`), applied to the raw logits before
temperature and the filters, in this order (vLLM's): logits + bias (-inf outside allowed_token_ids and at one-token
bad words); -inf at EOS and stop_token_ids while fewer than min_tokens output tokens exist, and at the last token
of each longer bad word whose other tokens end the output; the repetition penalty on tokens seen in the prompt or
the output (a positive logit divided by it, a negative one multiplied); minus frequency * count and presence *
[count > 0] over the output tokens.

Lossless under speculation: a plain step processes the logits after the sequence's tokens; a verify processes the
logits after draft node j with the sequence's tokens plus the drafts on the path from the root to j (its ancestors
and j itself), exactly the tokens a plain step would have seen after committing them, with the same element-wise
operations (`apply`), so the same bits.

Counts live on the device (`TokenCounts`, one per request that asks, folded forward from the host's tokens a step
at a time). With overlap scheduling the previous step's token is still on the device when the next one samples; it
is added from the device (`ModelRunner.pending_tokens`), so requests with these options overlap like any other. A
batch in which no request asks does no work here. Grammar masks (structured output) come after these processors,
see `layers.grammar`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..device import to_device
from .grammar import mask_logits

_INF = float("inf")
_ANY = -2  # a bad word's prefix, right-aligned in `word_bans`' width: this position matches any token


def apply(logits: torch.Tensor, bias: torch.Tensor, banned: torch.Tensor, prompt: torch.Tensor,
          counts: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """The processed logits [R, V] of logits [R, V] fp32: bias [R, V], banned [R, V] bool (min_tokens),
    prompt [R, V] bool (tokens of the prompt), counts [R, V] fp32 (of the output tokens), rep / freq /
    pres [R, 1] (1, 0, 0 leave a row unchanged). Element-wise only: each row's result is the same bits
    whatever else the batch holds."""
    logits = (logits + bias).masked_fill(banned, -_INF)
    penalty = torch.where(prompt | (counts > 0), rep, 1.0)  # [R, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    return logits - freq * counts - pres * (counts > 0).float()


class TokenCounts:
    """A request's tokens on the device: `counts` [V] fp32 of its output tokens (folded in from the host
    as they arrive), `prompt` [V] bool, its logit_bias as a dense `bias` [V] (-inf outside allowed_token_ids
    and at one-token bad words) and `stops` [V] bool (EOS and stop_token_ids, which min_tokens holds back);
    its bad words of several tokens as `word_prefixes` [words, word_width] (the tokens before the last,
    right-aligned, _ANY before them) and `word_lasts` [words] (None without such words)."""

    def __init__(self, seq, vocab: int, device: torch.device):
        params = seq.params
        self.counts = torch.zeros(vocab, device=device)
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1:
            self.prompt[to_device(seq.token_ids[:seq.num_prompt_tokens], torch.long, device)] = True
        self.bias = torch.zeros(vocab, device=device)
        if params.logit_bias:
            ids, values = zip(*params.logit_bias.items())
            self.bias[to_device(list(ids), torch.long, device)] = to_device(list(values), torch.float32, device)
        if params.allowed_token_ids is not None:
            outside = torch.ones(vocab, dtype=torch.bool, device=device)
            outside[to_device(params.allowed_token_ids, torch.long, device)] = False
            self.bias.masked_fill_(outside, -_INF)
        words = params.bad_words_token_ids or []
        singles = [word[0] for word in words if len(word) == 1]
        if singles:
            self.bias[to_device(singles, torch.long, device)] = -_INF
        longer = [word for word in words if len(word) > 1]
        self.word_width = max((len(word) - 1 for word in longer), default=0)
        self.word_prefixes = to_device([[_ANY] * (self.word_width + 1 - len(w)) + list(w[:-1]) for w in longer],
                                       torch.long, device) if longer else None
        self.word_lasts = to_device([w[-1] for w in longer], torch.long, device) if longer else None
        self._tables: dict = {}
        self.stops = torch.zeros(vocab, dtype=torch.bool, device=device)
        stops = sorted(set(seq.eos_token_ids) | set(params.stop_token_ids))
        if stops:
            self.stops[to_device(stops, torch.long, device)] = True
        self.folded = 0  # output tokens counted so far

    def word_table(self, width: int, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This request's bad words for `nodes` contexts of `width` tokens: (context [E], prefixes [E, width],
        lasts [E]), every word once per context (E = words * nodes); made once per (width, nodes)."""
        key = (width, nodes)
        if key not in self._tables:
            k = self.word_lasts.shape[0]
            prefixes = torch.nn.functional.pad(self.word_prefixes, (width - self.word_width, 0), value=_ANY)
            context = torch.arange(nodes, device=self.word_lasts.device).repeat_interleave(k)
            self._tables[key] = (context, prefixes.repeat(nodes, 1), self.word_lasts.repeat(nodes))
        return self._tables[key]

    def update(self, seq) -> "TokenCounts":
        """Count the output tokens the host learned since the last update."""
        new = seq.token_ids[seq.num_prompt_tokens + self.folded:]
        if new:
            ids = to_device(new, torch.long, self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(new), device=self.counts.device))
            self.folded += len(new)
        return self


def token_counts(seq, vocab: int, device: torch.device) -> TokenCounts:
    """seq's up-to-date TokenCounts, made on first use (kept on seq.logits_state)."""
    if seq.logits_state is None:
        seq.logits_state = TokenCounts(seq, vocab, device)
    return seq.logits_state.update(seq)


class Batch:
    """The per-row tensors `apply` takes for requests seqs (each asks for some processing), stacked:
    [R, V] from their TokenCounts and [R, 1] from their params."""

    def __init__(self, seqs: Sequence, vocab: int, device: torch.device):
        states = [token_counts(s, vocab, device) for s in seqs]
        self.bias = torch.stack([c.bias for c in states])  # [R, V]
        self.prompt = torch.stack([c.prompt for c in states])  # [R, V]
        self.counts = torch.stack([c.counts for c in states])  # [R, V]
        self.stops = torch.stack([c.stops for c in states])  # [R, V]
        self.states = states
        self.num_output = [s.num_tokens - s.num_prompt_tokens for s in seqs]  # pending tokens included
        self.min_tokens = [s.params.min_tokens for s in seqs]

        def column(name: str) -> torch.Tensor:
            return to_device([getattr(s.params, name) for s in seqs], torch.float32, device)[:, None]

        self.rep, self.freq, self.pres = column("repetition_penalty"), column("frequency_penalty"), \
            column("presence_penalty")


def processed_rows(seqs: Sequence) -> list[int]:
    """The rows that need processing (a request whose only option is a min_tokens it has reached does not)."""
    return [i for i, s in enumerate(seqs) if s.params.processes_logits and (
        s.params.has_penalties or s.params.has_bias or s.params.has_bad_words
        or s.num_tokens - s.num_prompt_tokens < s.params.min_tokens)]


def word_bans(contexts: torch.Tensor, states: Sequence[TokenCounts], vocab: int) -> torch.Tensor:
    """[X, V] bool: the last token of each bad word whose other tokens end its context, for contexts [X, W]
    (the last W tokens, -1 where there are fewer), X / len(states) contexts a request in a row, and the
    requests' TokenCounts."""
    nodes, width, dev = contexts.shape[0] // len(states), contexts.shape[1], contexts.device
    tables = [(r, c.word_table(width, nodes)) for r, c in enumerate(states) if c.word_lasts is not None]
    rows = torch.cat([context + r * nodes for r, (context, _, _) in tables])  # [E]
    prefixes = torch.cat([p for _, (_, p, _) in tables])  # [E, W]
    lasts = torch.cat([last for _, (_, _, last) in tables])  # [E]
    match = ((contexts[rows] == prefixes) | (prefixes == _ANY)).all(1)  # [E]
    bans = torch.zeros(contexts.shape[0], vocab, device=dev)
    bans.index_put_((rows, lasts), match.float(), accumulate=True)
    return bans > 0


def word_width(batch: "Batch") -> int:
    """The most tokens any bad word of the batch has before its last one (0: no word of several tokens)."""
    return max(c.word_width for c in batch.states)


def output_tails(seqs: Sequence, width: int, pending: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[len(seqs), width] long: each sequence's last width output tokens, the pending one (overlap scheduling)
    read from pending at its row, -1 before the first output token."""
    rows = []
    for seq in seqs:
        known = width - seq.num_pending
        tail = seq.token_ids[seq.num_prompt_tokens:][-known:] if known > 0 else []
        rows.append([-1] * (known - len(tail)) + tail + [0] * seq.num_pending)
    tails = to_device(rows, torch.long, device)
    waiting = [k for k, s in enumerate(seqs) if s.num_pending]
    if waiting:
        tails[to_device(waiting, torch.long, device), width - 1] = \
            pending[to_device([seqs[k].pending_row for k in waiting], torch.long, device)]
    return tails


def process_logits(logits: torch.Tensor, seqs: Sequence, pending: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits [len(seqs), V] after each sequence's tokens, processed for the rows that ask (the same
    tensor when none does), grammar masks last (`layers.grammar`). pending [rows]: the in-flight step's
    sampled tokens, read at seq.pending_row by sequences whose last token is still on the device
    (seq.num_pending)."""
    rows = processed_rows(seqs)
    if rows:  # in fp32 (the model's logits may be half precision)
        logits = penalise(logits.float(), seqs, rows, pending)
    return mask_logits(logits, seqs, pending)


def penalise(logits: torch.Tensor, seqs: Sequence, rows: list[int], pending: Optional[torch.Tensor]) -> torch.Tensor:
    """`process_logits` without the grammar, for rows (those that ask) of logits [len(seqs), V]."""
    v, dev = logits.shape[-1], logits.device
    batch = Batch([seqs[i] for i in rows], v, dev)
    waiting = [k for k, i in enumerate(rows) if seqs[i].num_pending]
    if waiting:
        tokens = pending[to_device([seqs[rows[k]].pending_row for k in waiting], torch.long, dev)]  # [W]
        batch.counts[to_device(waiting, torch.long, dev), tokens] += 1
    early = to_device([n < m for n, m in zip(batch.num_output, batch.min_tokens)], torch.bool, dev)  # [R]
    banned = batch.stops & early[:, None]  # [R, V]
    width = word_width(batch)
    if width:
        banned |= word_bans(output_tails([seqs[i] for i in rows], width, pending, dev), batch.states, v)
    index = to_device(rows, torch.long, dev)
    out = logits.clone()
    out[index] = apply(logits[index], batch.bias, banned, batch.prompt, batch.counts, batch.rep, batch.freq,
                       batch.pres)
    return out


def process_one(logits: torch.Tensor, params, prompt: list[int], output: list[int], stops: set[int]
                ) -> torch.Tensor:
    """logits [V] after the tokens prompt + output, processed for params (stops: EOS and stop_token_ids):
    one row built from Python lists, the reference the batched functions are checked against."""
    v, dev = logits.shape[-1], logits.device
    bias, banned, seen, counts = [0.0] * v, [False] * v, [False] * v, [0.0] * v
    for token, value in params.logit_bias.items():
        bias[token] = float(value)
    if params.allowed_token_ids is not None:
        bias = [b if t in params.allowed_token_ids else -_INF for t, b in enumerate(bias)]
    for token in stops if len(output) < params.min_tokens else ():
        banned[token] = True
    for word in params.bad_words_token_ids or ():
        before = list(word[:-1])
        if len(before) <= len(output) and output[len(output) - len(before):] == before:
            banned[word[-1]] = True
    for token in prompt if params.repetition_penalty != 1 else ():
        seen[token] = True
    for token in output:
        counts[token] += 1

    def row(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([values], dtype=dtype, device=dev)

    return apply(logits[None].float(), row(bias, torch.float32), row(banned, torch.bool), row(seen, torch.bool),
                 row(counts, torch.float32), row([params.repetition_penalty], torch.float32),
                 row([params.frequency_penalty], torch.float32), row([params.presence_penalty], torch.float32))[0]


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: node i's drafts on its path, i.e. j is i or an ancestor of i other than the root,
    for trees parents [B, N] (-1 at the root, a parent before its child)."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)  # [B, N, N]
    rows = torch.arange(b, device=parents.device)
    for j in range(1, n):
        mask[:, j] |= mask[rows, parents[:, j]]
    mask[:, :, 0] = False
    return mask


def path_tails(tails: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[R, N, W]: the last W tokens after each node of R trees (tokens, parents [R, N]; depth [R, N], the drafts
    on each node's path), its path's drafts after the sequence's output tails [R, W]."""
    width = tails.shape[1]
    node = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)  # [R, N]
    out = torch.empty(*tokens.shape, width, dtype=torch.long, device=tokens.device)
    for back in range(width):  # the token `back` places before the end
        w = width - 1 - back
        on_path = back < depth
        out[..., w] = torch.where(on_path, tokens.gather(1, node), tails.gather(1, (w + depth).clamp(max=width - 1)))
        node = torch.where(on_path, parents.gather(1, node).clamp(min=0), node)
    return out


def process_tree_logits(logits: torch.Tensor, seqs: Sequence, tokens: torch.Tensor,
                        parents: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] after each node of B draft trees (tokens, parents [B, N]), processed for the rows
    that ask as a plain step would process them after the sequence's tokens and the node's path."""
    rows = processed_rows(seqs)
    if not rows:
        return logits
    logits = logits.float()  # [B, N, V] (the model's may be half precision)
    b, n, v = logits.shape
    dev = logits.device
    index = to_device(rows, torch.long, dev)
    batch = Batch([seqs[i] for i in rows], v, dev)
    path = ancestors(parents[index]).float()  # [R, N, N]
    counts = batch.counts[:, None].repeat(1, n, 1)  # [R, N, V]
    counts.scatter_add_(2, tokens[index][:, None, :].expand(-1, n, -1), path)
    depth = path.sum(-1)  # [R, N] drafts on each node's path
    early = depth + to_device(batch.num_output, torch.float32, dev)[:, None] \
        < to_device(batch.min_tokens, torch.float32, dev)[:, None]  # [R, N]
    r = len(rows)

    def per_node(x: torch.Tensor) -> torch.Tensor:  # [R, ...] -> [R * N, ...]
        return x[:, None].expand(r, n, *x.shape[1:]).reshape(r * n, *x.shape[1:])

    banned = (batch.stops[:, None] & early[:, :, None]).reshape(r * n, v)
    width = word_width(batch)
    if width:
        tails = output_tails([seqs[i] for i in rows], width, None, dev)  # [R, W]
        contexts = path_tails(tails, tokens[index], parents[index], depth.long())  # [R, N, W]
        banned |= word_bans(contexts.reshape(r * n, width), batch.states, v)
    processed = apply(logits[index].reshape(r * n, v), per_node(batch.bias), banned, per_node(batch.prompt),
                      counts.reshape(r * n, v), per_node(batch.rep), per_node(batch.freq), per_node(batch.pres))
    out = logits.clone()
    out[index] = processed.view(r, n, v)
    return out
