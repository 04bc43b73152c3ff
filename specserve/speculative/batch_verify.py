"""Batched verification: the draft trees of a whole step verified at once, on device tensors.

The per-request functions in verify.py are the reference: for the same draft trees, target
distributions and random numbers these return the same paths and tokens, bit for bit. Every tree of
a batch has the same number of nodes N (node 0 the root, a parent before its children), but shapes
may differ per row. Nothing here reads a value back to the host and nothing loops over the batch in
Python. The reference walks each tree from the root, testing a node's children in node order until one
is accepted; here every node's test is decided at once, as the walk would decide it if it got there
(`verify_batch`), and the accepted nodes are read from the trees' ancestor bitmasks.

Sampling rows follow `verify_sampling` exactly, including its float64 acceptance arithmetic. Greedy
rows take the argmax of the raw logits and need no random numbers.

Seeded sampling rows (`SamplingParams.seed`) verify like greedy rows whose "argmax" after node j is the
seeded Gumbel-max token (`layers.sampler.seeded_tokens`) at the sequence index that token would take:
the request's position (the index of the token after the root, `Sequence.num_tokens` before the step)
plus the depth of node j. A draft child is accepted iff it equals that token, and the recovered or bonus
token is the one at the last accepted node: exactly the tokens a plain step would draw at each index,
so a seeded request emits the same text with or without speculation. For point-mass drafts this
accepts child x with probability p(x), as recursive rejection sampling does.

Requests with penalties, logit_bias, min_tokens or a grammar verify against logits processed at each
node as a plain step would process them after the node's path (`process_drafts`, before any of the above).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..device import to_device
from ..layers.grammar import mask_tree_logits
from ..layers.logits_processors import process_tree_logits, processed_rows
from ..layers.sampler import Positions, filtered_logits, seeded_tokens
from ..sampling_params import SamplingParams
from .tree import DraftTree, step_tokens
from .verify import Verdict

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class BatchVerdict:
    accept_len: torch.Tensor  # [B] accepted drafts, 0..depth; accept_len + 1 output tokens are valid
    path: torch.Tensor  # [B, N] accepted node indices from the root (0), then -1
    out_tokens: torch.Tensor  # [B, N] accepted drafts, the recovered or bonus token, then -1


def draw_verify_random(num_nodes: int, vocab: int, generators: Sequence[Optional[torch.Generator]],
                       greedy: Sequence[bool], device: torch.device, default: Optional[torch.Generator] = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers of one verify per row: uniforms [B, N] and Exp(1) noise [B, V].

    A sampling row with a generator draws exactly what `verify_sampling` draws from it: torch.rand(N),
    then exponential_ over the vocabulary, in that order, so a row with its own generator verifies the
    same way batched or alone. Rows without a generator draw from `default` (the engine's; None: the global
    RNG), all of them in two calls (not in `verify_sampling`'s per-request order). Greedy rows leave their
    generator untouched; their entries are unused.
    """
    uniforms = torch.rand(len(generators), num_nodes, device=device, generator=default)  # [B, N]
    noise = torch.empty(len(generators), vocab, device=device).exponential_(generator=default)  # [B, V]
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            uniforms[i] = torch.rand(num_nodes, device=device, generator=gen)
            noise[i].exponential_(generator=gen)
    return uniforms, noise


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """probs [B, N, V] = softmax(filtered_logits) of logits [B, N, V], one `filtered_logits` call for all
    rows (row b with params[b]); greedy rows are filtered as if unfiltered and are not meant to be used."""
    b, n, v = logits.shape
    rows = [_GREEDY if p.greedy else p for p in params for _ in range(n)]
    return filtered_logits(logits.reshape(b * n, v), rows).softmax(-1).view(b, n, v)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] the depth of each node (the root 0) of trees parents [B, N] (a parent before its child)."""
    b, n = parents.shape
    depth = torch.zeros(b, n, dtype=torch.long, device=parents.device)
    for j in range(1, n):
        depth[:, j] = depth.gather(1, parents[:, j:j + 1]).squeeze(1) + 1
    return depth


def ancestor_bits(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 of trees parents [B, N] (-1 at the root, at most 64 nodes): bit j of node i set when node j is
    i or an ancestor of it (what `tree_bitmask` gives of the tree's attention mask), by pointer doubling."""
    n = parents.shape[1]
    bits = torch.ones_like(parents) << torch.arange(n, device=parents.device)  # [B, N] each node itself
    up = parents  # [B, N] the ancestor 2^k levels up (-1: past the root)
    for _ in range(max(0, n - 1).bit_length()):
        above = up >= 0
        bits = bits | torch.where(above, bits.gather(1, up.clamp(min=0)), 0)
        up = torch.where(above, up.gather(1, up.clamp(min=0)), -1)
    return bits


def seeded_targets(logits: torch.Tensor, params: Sequence[SamplingParams], positions: torch.Tensor,
                   depths: torch.Tensor) -> torch.Tensor:
    """[S, N] the seeded sample after each node of S seeded rows: logits [S, N, V], params [S] (seeded),
    positions [S] (the sequence index of the token after each root), depths [S, N] (see `node_depths`)."""
    s, n, v = logits.shape
    rows = [p for p in params for _ in range(n)]
    return seeded_tokens(logits.reshape(s * n, v), rows, (positions[:, None] + depths).reshape(-1)).view(s, n)


def verify_batch(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor,
                 probs: Optional[torch.Tensor] = None, uniforms: Optional[torch.Tensor] = None,
                 noise: Optional[torch.Tensor] = None, argmax: Optional[torch.Tensor] = None) -> BatchVerdict:
    """Verify B draft trees of N nodes at once: `verify_nodes`' accepted nodes and final tokens as a verdict."""
    return path_verdict(tokens, *verify_nodes(tokens, parents, logits, greedy, probs, uniforms, noise, argmax))


def verify_nodes(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor,
                 probs: Optional[torch.Tensor] = None, uniforms: Optional[torch.Tensor] = None,
                 noise: Optional[torch.Tensor] = None, argmax: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The nodes [B, N] bool that B draft trees of N nodes accept, and the token [B] after the last of them.

    tokens [B, N] long: node tokens, column 0 the root; parents [B, N] long, -1 at the root;
    logits [B, N, V] (the model's dtype): the target's raw logits after each node; greedy [B] bool.
    Greedy rows accept the child whose token is the argmax of `logits` (as `verify_greedy`).
    Sampling rows need probs [B, N, V] (the target's sampling distribution, see `sampling_probs`),
    uniforms [B, N] and noise [B, V] (see `draw_verify_random`), and verify as `verify_sampling`:
    the d-th child test of its walk uses uniforms[b, d]. probs may be None only if every row is greedy;
    greedy rows ignore their probs, uniforms and noise. argmax [B, N]: the token a greedy row takes
    after each node, when not the argmax of `logits` (seeded rows pass their seeded samples).

    Without the walk: every node's test is decided at once, as the walk would decide it if it got there
    (its parent accepted, its earlier siblings rejected): p(token | parent) over the mass the earlier
    siblings left (subtracted one by one in sibling order, as the walk does), against the uniform of the
    walk's test index there (one test per earlier sibling of the node and of each of its ancestors, and one
    per ancestor below the root). A node is accepted when it and every ancestor pass and no earlier sibling
    of theirs does (`accepted_nodes`); the last accepted node's children were all tested and rejected.
    """
    b, n = tokens.shape
    dev = tokens.device
    cols = torch.arange(n, device=dev)  # [N]
    argmax = logits.argmax(-1) if argmax is None else argmax  # [B, N]
    par = parents.clamp(min=0)  # [B, N]
    child_p = (tokens == argmax.gather(1, par)).double()  # [B, N] greedy: p(child) is one-hot
    u = torch.zeros(b, n, dtype=torch.float64, device=dev)  # [B, N] greedy: accept iff p(child) > 0
    if probs is not None:
        v = probs.shape[-1]
        target_p = probs.reshape(b, n * v).gather(1, par * v + tokens).double()  # [B, N] p(token | parent)
        child_p = torch.where(greedy[:, None], child_p, target_p)
        u = torch.where(greedy[:, None], u, uniforms.double())
    earlier = earlier_siblings(parents)  # [B, N, N]
    rank = earlier.sum(2)  # [B, N] earlier siblings
    before = torch.where(earlier, cols, -1).amax(2)  # [B, N] the sibling just before (-1: none)
    first_child, before = before < 0, before.clamp(min=0)
    left = torch.ones(b, n, dtype=torch.float64, device=dev)  # [B, N] mass left when the node is tested
    for _ in range(n - 2):  # after k rounds, exact for the first k + 1 siblings
        left = torch.where(first_child, 1.0, (left - child_p).gather(1, before))
    p = torch.where(left > 0, child_p / left, 0.0)
    bits = ancestor_bits(parents)  # [B, N]
    above = ((bits.gather(1, par)[:, :, None] >> cols) & 1).bool() & (cols > 0)  # [B, N, N] (j, w): w above j
    tests = (above * (rank + 1)[:, None, :]).sum(2) + rank  # [B, N] the walk's test index at each node
    passed = (u.gather(1, tests) < p) | (parents < 0)  # [B, N]
    on_path = accepted_nodes(passed, earlier, bits)
    last = torch.where(on_path, cols, 0).amax(1)  # [B]
    final = argmax.gather(1, last[:, None]).squeeze(1)  # [B] greedy: recovered or bonus token
    if probs is not None:
        rows = torch.arange(b, device=dev)
        hit = torch.zeros(b, v + 1, dtype=torch.bool, device=dev)  # [B, V + 1] column V: not rejected
        hit.scatter_(1, torch.where(parents == last[:, None], tokens, v), True)  # the last node's children
        residual = probs[rows, last].masked_fill(hit[:, :v], 0)  # [B, V]
        final = torch.where(greedy, final, (residual / noise).argmax(-1))
    return on_path, final


def accepted_nodes(passed: torch.Tensor, earlier: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: the nodes that pass (passed [B, N], the root included), the first to pass of their
    siblings (earlier [B, N, N]: (j, i) when i is an earlier sibling of j), with every ancestor too (bits
    [B, N]: `ancestor_bits`)."""
    cols = torch.arange(passed.shape[1], device=passed.device)  # [N]
    shadowed = (earlier & passed[:, None, :]).any(2)  # [B, N] an earlier sibling passed
    chosen = ((passed & ~shadowed).long() << cols).sum(1, keepdim=True)  # [B, 1] distinct bits: their OR
    return (bits & ~chosen) == 0


def path_verdict(tokens: torch.Tensor, on_path: torch.Tensor, final: torch.Tensor) -> BatchVerdict:
    """The verdict of accepted nodes on_path [B, N] (a root-to-node path per row) whose last node is
    followed by the target token final [B]."""
    b, n = tokens.shape
    cols = torch.arange(n, device=tokens.device).expand(b, n)  # [B, N]
    order = torch.where(on_path, cols, n).sort(-1).values  # [B, N] path nodes ascending, then n
    accept_len = on_path.sum(1) - 1  # [B]
    path = order.masked_fill(order == n, -1)
    drafts = tokens.gather(1, order.clamp(max=n - 1)).roll(-1, 1)  # [B, N] tokens of path[1:]
    last = accept_len[:, None]
    out_tokens = torch.where(cols < last, drafts, torch.where(cols == last, final[:, None], -1))
    return BatchVerdict(accept_len, path, out_tokens)


def chain_verdict(tokens: torch.Tensor, argmax: torch.Tensor, accept_len: torch.Tensor,
                  final: Optional[torch.Tensor] = None) -> BatchVerdict:
    """`path_verdict` for chains tokens [B, N] (node i's parent is i - 1) whose first accept_len [B] drafts
    are accepted, followed by the target's token argmax [B, N] after the last of them (or final [B] when
    given), without sorting."""
    b, n = tokens.shape
    cols = torch.arange(n, device=tokens.device).expand(b, n)  # [B, N]
    last = accept_len[:, None]  # [B, 1]
    final = argmax.gather(1, last) if final is None else final[:, None]  # [B, 1]
    path = torch.where(cols <= last, cols, -1)
    out_tokens = torch.where(cols < last, tokens.roll(-1, 1), torch.where(cols == last, final, -1))
    return BatchVerdict(accept_len, path, out_tokens)


def chain_accept_len(tokens: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """[B] the leading drafts of chains tokens [B, N] that equal the target's argmax [B, N] after their parent."""
    return (tokens[:, 1:] == argmax[:, :-1]).long().cumprod(1).sum(1)


def tree_accepted(tokens: torch.Tensor, parents: torch.Tensor, bits: torch.Tensor, argmax: torch.Tensor
                  ) -> torch.Tensor:
    """The nodes [B, N] bool of trees tokens, parents [B, N] (-1 at the root) that `verify_batch` accepts for
    greedy rows after the target's argmax [B, N]: a node whose token is the argmax after its parent, the
    first such of its siblings, with every ancestor accepted too, read from bits [B, N] (each node's ancestor
    bitmask, bit j: node j is it or an ancestor; `tree_bitmask`'s, at most 64 nodes)."""
    match = (tokens == argmax.gather(1, parents.clamp(min=0))) | (parents < 0)  # [B, N]
    return accepted_nodes(match, earlier_siblings(parents), bits)


def earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool of trees parents [B, N]: (j, i) when node i is an earlier sibling of node j."""
    cols = torch.arange(parents.shape[1], device=parents.device)  # [N]
    return (parents[:, :, None] == parents[:, None, :]) & (cols[None, :] < cols[:, None])


def path_end(on_path: torch.Tensor, argmax: torch.Tensor, nodes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B] the target's token after the last accepted node of on_path [B, N] (a path's nodes increase), from
    argmax [B, N]; nodes: arange(N) on their device, when the caller has it made."""
    nodes = torch.arange(on_path.shape[1], device=on_path.device) if nodes is None else nodes  # [N]
    last = torch.where(on_path, nodes, 0).amax(1)  # [B]
    return argmax.gather(1, last[:, None]).squeeze(1)


def verify_greedy_trees(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                        argmax: Optional[torch.Tensor] = None) -> BatchVerdict:
    """`verify_batch` for trees of greedy rows, in fewer operations (`tree_accepted`: no sampling arithmetic);
    argmax [B, N] as `verify_batch`'s."""
    argmax = logits.argmax(-1) if argmax is None else argmax  # [B, N]
    on_path = tree_accepted(tokens, parents, ancestor_bits(parents), argmax)
    return path_verdict(tokens, on_path, path_end(on_path, argmax))


def verify_chains(tokens: torch.Tensor, logits: torch.Tensor, greedy: torch.Tensor, probs: torch.Tensor,
                  uniforms: torch.Tensor, noise: torch.Tensor, argmax: Optional[torch.Tensor] = None,
                  drawn: Optional[torch.Tensor] = None) -> BatchVerdict:
    """`verify_batch` for chains (node i's parent is i - 1), same arguments but the parents, in fewer operations:
    draft i is accepted when every draft before it is and uniforms[b, i - 1] < p(draft i | node i - 1) (greedy
    rows: when it is the argmax after node i - 1); a sampling row's final token is drawn with noise from the
    target's distribution after its last accepted node less the draft tested next. The same random numbers
    give `verify_batch`'s verdict. drawn [B]: drafts to accept instead where >= 0 (synthetic acceptance)."""
    b, n = tokens.shape
    v = probs.shape[-1]
    argmax = logits.argmax(-1) if argmax is None else argmax  # [B, N]
    drafts = tokens[:, 1:]  # [B, N - 1]
    target_p = probs[:, :-1].gather(2, drafts[:, :, None]).squeeze(2).double()  # [B, N - 1] p(draft | parent)
    accepted = torch.where(greedy[:, None], drafts == argmax[:, :-1], uniforms[:, :-1].double() < target_p)
    accept_len = accepted.long().cumprod(1).sum(1)  # [B]
    if drawn is not None:
        accept_len = torch.where(drawn >= 0, drawn, accept_len)
    rejected = torch.where(accept_len + 1 < n, tokens.gather(1, (accept_len + 1).clamp(max=n - 1)[:, None]).squeeze(1),
                           v)  # [B] the draft tested and rejected after the last accepted node (v: none)
    hit = torch.zeros(b, v + 1, dtype=torch.bool, device=tokens.device).scatter_(1, rejected[:, None], True)
    residual = probs[torch.arange(b, device=tokens.device), accept_len].masked_fill(hit[:, :v], 0)  # [B, V]
    final = torch.where(greedy, argmax.gather(1, accept_len[:, None]).squeeze(1), (residual / noise).argmax(-1))
    return chain_verdict(tokens, argmax, accept_len, final)


def verify_greedy_chains(tokens: torch.Tensor, logits: torch.Tensor,
                         argmax: Optional[torch.Tensor] = None) -> BatchVerdict:
    """`verify_batch` for chains (node i's parent is i - 1) of greedy rows, in fewer operations:
    the accepted drafts are the leading ones that equal the target's argmax after their parent (or
    argmax [B, N] when given, as in `verify_batch`)."""
    argmax = logits.argmax(-1) if argmax is None else argmax  # [B, N]
    return chain_verdict(tokens, argmax, chain_accept_len(tokens, argmax))


def verify_batch_params(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
                        params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
                        chains: bool = False, positions: Optional[Positions] = None,
                        default: Optional[torch.Generator] = None) -> BatchVerdict:
    """`verify` for a batch: row b verified with params[b] and generators[b] (None: `default`, the engine's
    generator; both None: the global RNG).
    Draws the random numbers, filters the logits of all rows in one call, and calls `verify_batch`, or for
    chains (every tree is a chain) and batches without unseeded sampling rows its cheaper special cases
    (`verify_chains`, `verify_greedy_chains`, `verify_greedy_trees`).
    positions [B]: per row the sequence index of the token after the root (needed when a row is seeded;
    its generator is then unused)."""
    b, n, v = logits.shape
    greedy_rows = [p.greedy for p in params]
    seeded = [i for i, p in enumerate(params) if not p.greedy and p.seed is not None]
    argmax = None
    if seeded:
        if positions is None:
            raise ValueError("seeded verification needs each row's position")
        dev = logits.device
        idx = to_device(seeded, torch.long, dev)
        par = parents[idx]
        depths = torch.arange(n, device=dev).expand(len(seeded), n) if chains else node_depths(par)
        argmax = logits.argmax(-1)  # [B, N]
        argmax[idx] = seeded_targets(logits[idx], [params[i] for i in seeded],
                                     to_device(positions, torch.long, dev)[idx], depths)
        for i in seeded:
            greedy_rows[i] = True
    if all(greedy_rows):
        return verify_greedy_chains(tokens, logits, argmax) if chains else verify_greedy_trees(tokens, parents, logits,
                                                                                               argmax)
    greedy = to_device(greedy_rows, torch.bool, logits.device)
    uniforms, noise = draw_verify_random(n, v, generators, greedy_rows, logits.device, default)
    sampled = [_GREEDY if g else p for p, g in zip(params, greedy_rows)]  # seeded rows need no probs
    probs = sampling_probs(logits, sampled)
    if chains:
        return verify_chains(tokens, logits, greedy, probs, uniforms, noise, argmax)
    return verify_batch(tokens, parents, logits, greedy, probs, uniforms, noise, argmax)


def verify_drafts(trees: Sequence[DraftTree], logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[Optional[torch.Generator]], chains: bool, verifier=None,
                  positions: Optional[Positions] = None, default: Optional[torch.Generator] = None) -> list[Verdict]:
    """Verify a step's draft trees (all of N nodes; chains: every one a chain) against logits [B, N, V]:
    one verify for the batch and one read of its result to the host. verifier: a function with
    `verify_batch_params`' signature (default: that one; synthetic acceptance passes its own).
    positions [B]: per tree the sequence index of the token after its root (seeded rows need it); default:
    the generator of rows without their own (the engine's)."""
    device = logits.device
    tokens = step_tokens(trees, device)  # [B, N]
    parents = to_device([t.parents for t in trees], torch.long, device)  # [B, N]
    verdict = (verifier or verify_batch_params)(tokens, parents, logits, params, generators, chains, positions,
                                                default)
    rows = torch.cat([verdict.path, verdict.out_tokens], 1).tolist()  # [B, 2N] on the host, one sync
    n = tokens.shape[1]
    out = []
    for row in rows:
        path = [x for x in row[:n] if x >= 0]
        out.append(Verdict(path, row[n:n + len(path)]))
    return out


def process_drafts(seqs: Sequence, trees: Sequence[DraftTree], logits: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] after each node of the step's trees, processed (penalties, logit_bias, min_tokens:
    `layers.logits_processors`) for the sequences that ask, counting the drafts on each node's path as
    output tokens, then masked by the grammar after each node's path (`layers.grammar`); the same tensor
    when none asks."""
    if processed_rows(seqs):
        tokens = step_tokens(trees, logits.device)  # [B, N]
        parents = to_device([t.parents for t in trees], torch.long, logits.device)  # [B, N]
        logits = process_tree_logits(logits, seqs, tokens, parents)
    return mask_tree_logits(logits, seqs, trees)
