"""The prefix index: full KV blocks named by a hash chain over their tokens.

A full block's hash covers its parent's hash and its own tokens, so equal hashes name equal prefixes.
A lookup confirms a hash by comparing the block's tokens and its parent *node* (the object, not a hash),
so the index is a trie over blocks with a hash table in front of it: a collision costs a miss, never a
wrong hit. A `CachedBlock` is content; it lives in the device pool (`block`), in the host pool
(`host_slot`) or in both, and is dropped from the index, with its descendants, once it lives in neither.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

HashFn = Callable[[Optional[bytes], Sequence[int]], bytes]


def hash_block(parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
    """128-bit BLAKE2b of the parent block's hash and this block's token ids."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("I", tokens).tobytes())
    return h.digest()


@dataclass(eq=False)
class CachedBlock:
    hash: bytes
    tokens: tuple[int, ...]
    parent: Optional["CachedBlock"]
    block: Optional[int] = None  # device block holding this content
    host_slot: Optional[int] = None  # host pool slot holding a copy
    children: set["CachedBlock"] = field(default_factory=set)


@dataclass
class PrefixHit:
    """The cached blocks that start a request, in order (device-resident or host-resident)."""

    nodes: list[CachedBlock] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)

    @property
    def on_host(self) -> list[CachedBlock]:
        return [n for n in self.nodes if n.block is None]


class SeqPrefix:
    """A request's view of the index: its full blocks' chain hashes (content only, so they survive
    preemption) and the cached blocks its block table holds, in order (block_table[i] == nodes[i].block)."""

    def __init__(self, salt: Optional[bytes] = None) -> None:
        self.salt = salt  # the first block's parent hash (None: no salt)
        self.hashes: list[bytes] = []
        self.nodes: list[CachedBlock] = []
        self.stopped = False  # another block holds one of its hashes: register nothing further

    def hashes_for(self, token_ids: list[int], num_blocks: int, block_size: int, hash_fn: HashFn) -> list[bytes]:
        for i in range(len(self.hashes), num_blocks):
            parent = self.hashes[i - 1] if i else self.salt
            self.hashes.append(hash_fn(parent, token_ids[i * block_size:(i + 1) * block_size]))
        return self.hashes


class PrefixIndex:
    def __init__(self, hash_fn: HashFn = hash_block):
        self.hash_fn = hash_fn
        self.nodes: dict[bytes, CachedBlock] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def lookup(self, h: bytes, tokens: tuple[int, ...], parent: Optional[CachedBlock]) -> Optional[CachedBlock]:
        node = self.nodes.get(h)
        if node is None or node.parent is not parent or node.tokens != tokens:
            return None
        return node

    def insert(self, h: bytes, tokens: tuple[int, ...], parent: Optional[CachedBlock]) -> Optional[CachedBlock]:
        """A new node, or None when the hash is taken (by other content: a collision)."""
        if h in self.nodes:
            return None
        node = CachedBlock(h, tokens, parent)
        self.nodes[h] = node
        if parent is not None:
            parent.children.add(node)
        return node

    def remove(self, node: CachedBlock) -> list[CachedBlock]:
        """Take node and its descendants out of the index; returns them (descendants first)."""
        removed = list(_subtree(node))
        for n in removed:
            del self.nodes[n.hash]
        if node.parent is not None:
            node.parent.children.discard(node)
        return removed

    def contains(self, node: CachedBlock) -> bool:
        return self.nodes.get(node.hash) is node


def _subtree(node: CachedBlock) -> Iterator[CachedBlock]:
    for child in list(node.children):
        yield from _subtree(child)
    yield node
