"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts, and the
prefix cache over them.

The block manager owns no device tensors; the model runner's (and the draft's) KV tensors are indexed by
the block ids it hands out. A sequence's slot for token i is `block_table[i // block_size] * block_size
+ i % block_size`.

Prefix caching: a full block is registered in the prefix index once all its tokens are committed
(accepted tokens only: speculative tokens past the computed prefix never are) and, with speculation,
once the draft's state for it is final too (`draft_coverage`). A request admitted later whose tokens
start with cached blocks shares them (reference counts) and computes only the rest; its last token is
always computed, so a shared block is never written. Unreferenced cached blocks stay in the pool and
count as free; when a block is needed they are evicted least recently used first (a sequence releases
its blocks last-first, so a block goes before its prefix). With a host pool an evicted block keeps a
copy in host memory (made when it was registered: write_through, or when it is evicted: write_back),
and a later hit copies it back instead of recomputing it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Optional

from ..config import CacheConfig
from .kv_host import HostPool, HostTier, host_pool_slots
from .prefix_cache import CachedBlock, PrefixHit, PrefixIndex, SeqPrefix
from .sequence import Sequence
from .stats import PrefixCacheStats


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_pool: Optional[HostPool] = None, write_through: bool = False,
                 draft_coverage: Optional[Callable[[Sequence], int]] = None):
        """host_pool: copies of evicted (or, write_through, of every) cached block, in a host tier this
        manager keeps; draft_coverage(seq): the leading tokens of seq whose draft-side cache state is final
        (the proposer's `cached_tokens`; default: all computed ones)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enabled = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # unreferenced, holding no cached content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, oldest first
        self.block_node: list[Optional[CachedBlock]] = [None] * num_blocks
        self.index = PrefixIndex()
        self.host = HostTier(host_pool, write_through, self._drop) if host_pool is not None else None
        self.stats = PrefixCacheStats()
        self.draft_coverage: Callable[[Sequence], int] = draft_coverage or (lambda seq: seq.num_computed_tokens)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the cache holds seq's computed tokens plus num_new_tokens more."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Reserve slots for num_new_tokens tokens after seq's computed ones (registering the blocks the
        previous steps completed first)."""
        self._register(seq)
        needed = self.new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocks(f"{seq.request_id} needs {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            block = self._take()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep slots for the first num_tokens tokens only; release the blocks past them."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first; its complete blocks stay cached."""
        self._register(seq)
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        if seq.prefix_state is not None:
            seq.prefix_state.nodes, seq.prefix_state.stopped = [], False

    def reset(self) -> bool:
        """Forget every cached block, on the device and on the host; False (nothing changes) while a block is
        referenced."""
        if any(self.ref_counts):
            return False
        for root in [n for n in self.index.nodes.values() if n.parent is None]:
            self._drop(root)
        return True

    # ---- prefix hits ----------------------------------------------------------------------------
    def match(self, seq: Sequence) -> PrefixHit:
        """The cached blocks seq's tokens start with (no side effects). The last token is never part of
        a hit: its logits are needed; nor is any prompt token whose logprob the request still needs."""
        hit = PrefixHit()
        if not self.enabled or (seq.params.prompt_logprobs is not None
                                and len(seq.prompt_logprobs) < seq.num_prompt_tokens):
            return hit
        bs, tokens = self.block_size, seq.token_ids
        limit = (seq.num_tokens - 1) // bs
        hashes = self._state(seq).hashes_for(tokens, limit, bs, self.index.hash_fn)
        parent = None
        for i in range(limit):
            parent = self.index.lookup(hashes[i], tuple(tokens[i * bs:(i + 1) * bs]), parent)
            if parent is None:
                break
            hit.nodes.append(parent)
        return hit

    def can_admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Are there blocks for seq's hit (host blocks need device blocks; unreferenced device ones leave
        the free count) plus num_new_tokens more?"""
        revived = sum(1 for n in hit.nodes if n.block is not None and self.ref_counts[n.block] == 0)
        fresh = self.blocks_for(hit.num_blocks * self.block_size + num_new_tokens) - hit.num_blocks
        return revived + len(hit.on_host) + fresh <= self.num_free_blocks

    def admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> None:
        """Start seq on its cached prefix (sharing device blocks, copying host blocks back), then reserve
        slots for num_new_tokens more."""
        assert not seq.block_table and seq.num_computed_tokens == 0, f"{seq.request_id} is not new"
        on_host = hit.on_host
        for node in hit.nodes:
            if node.block is not None:
                self._acquire(node.block)
        if on_host:
            self.host.pin(on_host)  # evictions below must not take their host copies
            blocks = [self._take() for _ in on_host]
            for node, block in zip(on_host, blocks):
                self.ref_counts[block] = 1
                self._place(node, block)
            self.host.load(on_host, blocks)
        seq.block_table = [n.block for n in hit.nodes]
        self._state(seq).nodes = list(hit.nodes)
        seq.num_computed_tokens = hit.num_blocks * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        stats = self.stats
        stats.num_queries += seq.num_tokens
        stats.num_hits += seq.num_computed_tokens
        stats.num_host_hits += len(on_host) * self.block_size
        stats.num_host_loaded_blocks += len(on_host)
        self.append(seq, num_new_tokens)

    def num_cached_blocks(self, seq: Sequence) -> int:
        """How many of seq's leading complete blocks the cache already holds on the device (seq's own, or
        another copy of the same content that registering seq would swap in): their per-block state
        is final whatever seq's own copies hold."""
        if not self.enabled:
            return 0
        state, bs = self._state(seq), self.block_size
        complete = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        hashes = state.hashes_for(seq.token_ids, complete, bs, self.index.hash_fn)
        parent = None
        for i in range(complete):
            node = state.nodes[i] if i < len(state.nodes) else self.index.lookup(
                hashes[i], tuple(seq.token_ids[i * bs:(i + 1) * bs]), parent)
            if node is None or node.block is None:
                return i
            parent = node
        return complete

    # ---- registration ---------------------------------------------------------------------------
    def _register(self, seq: Sequence) -> None:
        """Enter seq's complete blocks into the index, in order. A block whose content is cached already
        is swapped for the cached one (the duplicate is freed)."""
        if not self.enabled:
            return
        state, bs = self._state(seq), self.block_size
        # tokens past the last kept one (a stop inside an accepted run) have KV but no place in a block
        complete = min(seq.num_computed_tokens, self.draft_coverage(seq), len(seq.token_ids)) // bs
        if state.stopped or complete <= len(state.nodes):
            return
        hashes = state.hashes_for(seq.token_ids, complete, bs, self.index.hash_fn)
        fresh: list[CachedBlock] = []
        for i in range(len(state.nodes), complete):
            parent = state.nodes[i - 1] if i else None
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block = seq.block_table[i]
            node = self.index.lookup(hashes[i], tokens, parent)
            if node is None:
                node = self.index.insert(hashes[i], tokens, parent)
                if node is None:  # the hash names other content: this block and those after stay private
                    state.stopped = True
                    break
                self._place(node, block)
                fresh.append(node)
            elif node.block is None:  # known from the host pool only: this block is its device copy now
                self._place(node, block)
            else:
                self._acquire(node.block)
                seq.block_table[i] = node.block
                self._release(block)
            state.nodes.append(node)
        if self.host is not None and self.host.write_through and fresh:
            self.stats.num_host_saved_blocks += self.host.save(fresh, self.index.contains)

    def _state(self, seq: Sequence) -> SeqPrefix:
        if seq.prefix_state is None:
            seq.prefix_state = SeqPrefix(seq.cache_salt)
        return seq.prefix_state

    def _place(self, node: CachedBlock, block: int) -> None:
        node.block = block
        self.block_node[block] = node

    # ---- reference counts and eviction ----------------------------------------------------------
    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released twice"
        if self.ref_counts[block] == 0:
            node = self.block_node[block]
            if node is None:
                self.free_blocks.append(block)
                return
            self.evictable[block] = None
            if self.host is not None:
                self.host.touch(node)

    def _take(self) -> int:
        """A block holding nothing: a clean one, else the least recently used cached one, evicted."""
        while not self.free_blocks:
            block = next(iter(self.evictable))
            node = self.block_node[block]
            if self.host is not None and node.host_slot is None:
                # finding a host slot may drop nodes, this one (with its prefix) included
                self.stats.num_host_saved_blocks += self.host.save([node], self.index.contains)
                if self.block_node[block] is not node:
                    continue  # dropped: the block is clean now
            del self.evictable[block]
            self.block_node[block] = None
            node.block = None
            self.stats.num_evicted_blocks += 1
            if node.host_slot is None:
                self._drop(node)
            return block
        return self.free_blocks.popleft()

    def _drop(self, node: CachedBlock) -> None:
        """node lives in neither pool: remove it and its descendants (unreachable now) from the index."""
        for n in self.index.remove(node):
            if self.host is not None:
                self.host.forget(n)
            if n.block is not None:
                assert self.ref_counts[n.block] == 0, "a cached block in use lost its prefix"
                del self.evictable[n.block]
                self.block_node[n.block] = None
                self.free_blocks.append(n.block)
                n.block = None

    def check(self) -> None:
        """Assert the pool's invariants: every block free, evictable or referenced (exactly one), every
        cached block where the index says, every host slot used once or free."""
        free, evictable = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks) and not free & evictable, "a block is free twice"
        for b in range(self.num_blocks):
            node, ref = self.block_node[b], self.ref_counts[b]
            assert (b in free) + (b in evictable) + (ref > 0) == 1, f"block {b}: free, evictable and ref {ref}"
            assert (node is None) == (b in free) or ref > 0, f"block {b}: cached content and free list disagree"
            assert node is None or (node.block == b and self.index.contains(node)), f"block {b}: stale node"
        for node in self.index.nodes.values():
            assert node.block is not None or node.host_slot is not None, "a cached block lives nowhere"
            assert node.block is None or self.block_node[node.block] is node
            assert node.parent is None or (self.index.contains(node.parent) and node in node.parent.children)
        on_host = [n for n in self.index.nodes.values() if n.host_slot is not None]
        assert self.host is not None or not on_host
        if self.host is not None:
            self.host.check(on_host)


def make_block_manager(cache: CacheConfig, runner, proposer) -> BlockManager:
    """The engine's block manager, with a host pool over the runner's (and the proposer's) KV planes
    when the configuration asks for one."""
    nb, bs = runner.num_blocks, runner.block_size
    # [blocks, layers, k/v, bs, kv_heads, dim] (the slot past the blocks is the graphs' scratch slot)
    planes = [runner.kv_cache[:, :, :nb * bs].unflatten(2, (nb, bs)).movedim(2, 0)]
    if proposer is not None:
        planes += proposer.cache_planes()
    slots = host_pool_slots(cache, planes, nb)
    return BlockManager(nb, bs, cache.enable_prefix_caching, HostPool(planes, slots) if slots > 0 else None,
                        cache.kv_host_policy == "write_through", proposer.cached_tokens if proposer else None)
