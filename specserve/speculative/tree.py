"""Draft trees: the tokens one request proposes for one verify, as a tree rooted at its last token.

Node 0 is the root (the last accepted token, whose KV the verify step computes); nodes 1..N-1 are
draft tokens in level order, so a parent always precedes its children. A chain is a tree whose node
i has parent i-1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..device import to_device


@dataclass
class DraftTree:
    tokens: Optional[list[int]]  # [N] target token ids, tokens[0] the root; None while only on the device
    parents: list[int]  # [N] parent node index; parents[0] = -1
    depth: Optional[list[int]] = field(default=None, repr=False)  # [N], when known from the selection
    mask: Optional[torch.Tensor] = field(default=None, repr=False)  # [N, N] bool, when selected on a device
    batch: Optional[torch.Tensor] = field(default=None, repr=False)  # [B, N] the step's tokens on the device
    row: int = 0  # this tree's row of `batch`

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        return cls([root] + drafts, [-1] + list(range(len(drafts))))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def num_drafts(self) -> int:
        return len(self.parents) - 1

    def host_tokens(self) -> list[int]:
        """The tokens on the host (read from the device the first time, when drafted there)."""
        if self.tokens is None:
            self.tokens = self.batch[self.row].tolist()
        return self.tokens

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        if self.depth is not None:
            return self.depth
        depth = [0] * self.size
        for i in range(1, self.size):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, self.size) if self.parents[i] == node]

    def spine(self, path: list[int]) -> tuple[int, int]:
        """Of the spine (from the root, each node's first child: the drafter's top-ranked chain), the drafts
        that the accepted path (node indices from the root) shares with it, and its length in drafts."""
        first = {}
        for i in range(self.size - 1, 0, -1):
            first[self.parents[i]] = i
        spine, node = [0], 0
        while node in first:
            node = first[node]
            spine.append(node)
        shared = next((i for i, (a, b) in enumerate(zip(spine, path)) if a != b), min(len(spine), len(path)))
        return shared - 1, len(spine) - 1

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or an ancestor of i."""
        if self.mask is not None:
            return self.mask
        mask = torch.eye(self.size, dtype=torch.bool)
        for i in range(1, self.size):
            mask[i] |= mask[self.parents[i]]
        return mask


def first_children(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows of trees parents [B, N] (-1 at the root): node indices cols [B, N], each node's parent slot
    child_of [B, N] (the root's: N), each node's first child first_child [B, N + 1] (N: none; slot N unused)
    and `later` [B, N]: the nodes that are not their parent's first child (the root excluded)."""
    b, n = parents.shape
    cols = torch.arange(n, device=parents.device).expand(b, n)
    child_of = torch.where(cols > 0, parents, n)
    first_child = torch.full((b, n + 1), n, dtype=torch.long, device=parents.device)
    first_child.scatter_reduce_(1, child_of, cols, "amin")
    later = (cols != first_child.gather(1, child_of)) & (cols > 0)
    return cols, child_of, first_child, later


def spine_counts(parents: torch.Tensor, bits: torch.Tensor, on_path: torch.Tensor) -> torch.Tensor:
    """`DraftTree.spine` on the device without a walk over the depths: per row of trees parents [B, N] with
    ancestor bitmasks bits [B, N] (bit j of node i: j is i or an ancestor of it) and accepted nodes on_path
    [B, N], [B, 2] (spine drafts accepted, spine length). A node is on the spine when it and its ancestors
    are each their parent's first child."""
    cols, _, _, later = first_children(parents)
    later_bits = (later.long() << cols).sum(1, keepdim=True)  # [B, 1] distinct bits: the sum is their OR
    spine = (bits & later_bits) == 0  # [B, N]
    return torch.stack([(spine & on_path).sum(1) - 1, spine.sum(1) - 1], 1)


def device_chains(roots: torch.Tensor, drafts: torch.Tensor) -> list[DraftTree]:
    """Chains of roots [B] and drafts [B, S] (on the device), whose tokens stay there until read."""
    batch = torch.cat([roots[:, None], drafts], 1)  # [B, S + 1]
    n = batch.shape[1]
    parents, depth = list(range(-1, n - 1)), list(range(n))
    return [DraftTree(None, parents, depth, batch=batch, row=b) for b in range(batch.shape[0])]


def step_tokens(trees: list[DraftTree], device: torch.device) -> torch.Tensor:
    """[B, N] the trees' tokens on the device: their shared batch when they are its rows in order."""
    batch = trees[0].batch
    if batch is not None and batch.shape[0] == len(trees) and all(
            t.batch is batch and t.row == b for b, t in enumerate(trees)):
        return batch
    return to_device([t.host_tokens() for t in trees], torch.long, device)


def select_tree(root: int, cand_tokens: torch.Tensor, cand_scores: torch.Tensor, cand_parents: torch.Tensor,
                num_nodes: int) -> DraftTree:
    """Keep the best num_nodes - 1 candidates by cumulative score, plus the root.

    cand_* [C] describe candidates in generation (level) order; cand_parents index candidates, -1 is the
    root. A child's score never exceeds its parent's, and the stable sort prefers earlier candidates on
    ties, so the kept set always contains every kept node's ancestors.
    """
    order = torch.sort(-cand_scores, stable=True).indices[:num_nodes - 1]
    keep = sorted(order.tolist())
    index = {c: i + 1 for i, c in enumerate(keep)}
    tokens, parents = [root], [-1]
    cand_tokens, cand_parents = cand_tokens.tolist(), cand_parents.tolist()
    for c in keep:
        tokens.append(cand_tokens[c])
        parents.append(0 if cand_parents[c] < 0 else index[cand_parents[c]])
    return DraftTree(tokens, parents)


def select_trees(roots: list[int], cand_tokens: torch.Tensor, cand_scores: torch.Tensor, cand_parents: torch.Tensor,
                 cand_depths: torch.Tensor, num_nodes: int, masks: bool = True) -> list[DraftTree]:
    """`select_tree` for a batch, on the candidates' device with one read to the host: cand_* [B, C]
    (cand_depths [C], the draft depth of each candidate), roots [B]. Each tree carries its depths and,
    with `masks`, its ancestor mask on the device (chains need none)."""
    tokens, parents, depths, mask = device_trees(cand_tokens, cand_scores, cand_parents, cand_depths, num_nodes,
                                                 masks)
    host = torch.cat([tokens, parents, depths], 1).tolist()  # [B, 3(N-1)]
    n = num_nodes - 1
    return [DraftTree([root] + row[:n], [-1] + row[n:2 * n], [0] + row[2 * n:], mask[i] if masks else None)
            for i, (root, row) in enumerate(zip(roots, host))]


def device_trees(cand_tokens: torch.Tensor, cand_scores: torch.Tensor, cand_parents: torch.Tensor,
                 cand_depths: torch.Tensor, num_nodes: int, masks: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`select_tree` for a batch without leaving the device: of candidates cand_* [B, C] (cand_depths [C]),
    the kept nodes' tokens, parent node indices (0: the root) and depths, each [B, N-1] for nodes 1..N-1,
    and with `masks` the ancestor masks [B, N, N] of the whole trees."""
    b, c = cand_tokens.shape
    dev = cand_tokens.device
    keep = torch.sort(-cand_scores, dim=1, stable=True).indices[:, :num_nodes - 1].sort(1).values  # [B, N-1]
    node_of = torch.zeros(b, c, dtype=torch.long, device=dev)  # [B, C] node index of each kept candidate
    node_of.scatter_(1, keep, torch.arange(1, num_nodes, device=dev).expand(b, -1))
    kept_parents = cand_parents.gather(1, keep)  # [B, N-1] candidate index, -1 = root
    parents = torch.where(kept_parents < 0, 0, node_of.gather(1, kept_parents.clamp(min=0)))  # [B, N-1]
    mask = torch.eye(num_nodes, dtype=torch.bool, device=dev).repeat(b, 1, 1) if masks else None  # [B, N, N]
    rows = torch.arange(b, device=dev)
    for i in range(1, num_nodes if masks else 1):  # a parent precedes its child
        mask[:, i] |= mask[rows, parents[:, i - 1]]
    return cand_tokens.gather(1, keep), parents, cand_depths[keep], mask
