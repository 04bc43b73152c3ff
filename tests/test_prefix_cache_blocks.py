"""The block manager's prefix cache as worked examples: hits, sharing, LRU order, collisions, host round trips."""
from __future__ import annotations

import torch

from specserve import SamplingParams
from specserve.engine.block_manager import BlockManager
from specserve.engine.kv_host import HostPool
from specserve.engine.sequence import Sequence


def seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(), set(), 1024, None)


def run(bm: BlockManager, s: Sequence) -> int:
    """Admit s, compute all its tokens (as a step would), return how many came from the cache."""
    hit = bm.match(s)
    cached = hit.num_blocks * bm.block_size
    assert bm.can_admit(s, hit, s.num_tokens - cached)
    bm.admit(s, hit, s.num_tokens - cached)
    s.num_computed_tokens = s.num_tokens
    return cached


def test_hits_are_whole_blocks_and_leave_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))  # blocks [0 1 2 3] [4 5 6 7] [8 9]
    assert run(bm, a) == 0
    bm.free(a)  # its two full blocks stay cached; the partial one is free
    assert bm.num_free_blocks == 8 and len(bm.evictable) == 2
    b = seq("b", list(range(8)) + [50, 51])
    assert run(bm, b) == 8  # both full blocks
    assert b.block_table[:2] == a.block_table[:2] if a.block_table else True
    c = seq("c", list(range(8)))  # 8 tokens: the last one must be computed, so only block 0 hits
    assert run(bm, c) == 4
    assert bm.ref_counts[c.block_table[0]] == 2  # shared by b and c
    d = seq("d", [0, 1, 2, 99, 4, 5, 6, 7, 8])  # differs inside block 0: nothing hits
    assert run(bm, d) == 0
    for s in (b, c, d):
        bm.free(s)
    bm.check()
    assert bm.stats.num_queries == 10 + 10 + 8 + 9 and bm.stats.num_hits == 12


def test_eviction_is_least_recently_used_and_deepest_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq("a", [1, 2, 3, 4, 5]), seq("b", [7, 8, 9])
    run(bm, a)
    run(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # cached: a's [1 2] [3 4] and b's [7 8]; released a's deepest first, then b
    assert list(bm.evictable) == [a_blocks[1], a_blocks[0], b_blocks[0]]
    big = seq("big", list(range(100, 109)))  # 5 blocks: the 3 clean ones and 2 evicted, a's first
    run(bm, big)
    assert list(bm.evictable) == [b_blocks[0]]
    bm.free(big)
    assert run(bm, seq("again", [7, 8, 0])) == 2  # b's block survived
    assert bm.stats.num_evicted_blocks == 2
    assert len(bm.index) == 1 + 4  # b's block and big's four full blocks


def test_same_content_computed_twice_is_shared_once_complete():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a", list(range(9))), seq("b", list(range(9)))
    run(bm, a)
    run(bm, b)  # admitted before a registered anything: computed its own copy
    assert a.block_table[0] != b.block_table[0]
    bm.append(a, 0)  # registration happens as blocks are reserved for the next step
    bm.append(b, 0)  # b finds its blocks cached and swaps in the cached copies, freeing its own
    assert a.block_table[:2] == b.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.free(a)
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 8 and len(bm.index) == 2


def test_a_colliding_hash_is_a_miss_never_a_wrong_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.index.hash_fn = lambda parent, tokens: bytes(tokens)  # ignores the parent: equal blocks collide
    a = seq("a", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    run(bm, a)
    bm.free(a)
    b = seq("b", [3, 3, 3, 3, 2, 2, 2, 2, 0])  # block 1 equals a's block 1 but follows other tokens
    assert run(bm, b) == 0
    bm.free(b)  # its block 0 is cached; its block 1's hash is taken, so it stays private
    assert len(bm.index) == 3
    c = seq("c", [3, 3, 3, 3, 2, 2, 2, 2, 5])
    assert run(bm, c) == 4  # [3 3 3 3] hits; [2 2 2 2] is found by hash but its parent is a's block: refused
    bm.free(c)
    bm.index.hash_fn = lambda parent, tokens: b"same"  # every block collides: at most one is cached
    d = seq("d", [7, 7, 7, 7, 8, 8, 8, 8, 9])
    run(bm, d)
    bm.free(d)
    # d's block 0 took "same"; its block 1 found the name taken and stayed private
    assert run(bm, seq("e", [7, 7, 7, 7, 8, 8, 8, 8, 9])) == 4
    assert run(bm, seq("f", [8, 8, 8, 8, 7, 7, 7, 7, 9])) == 0  # "same" names other content
    bm.check()


def host_manager(num_blocks: int, host_slots: int, write_through: bool):
    plane = torch.zeros(num_blocks, 3)  # stands for the KV: [blocks, ...]
    return BlockManager(num_blocks, 2, True, HostPool([plane], host_slots), write_through), plane


def fill(plane: torch.Tensor, s: Sequence, value: float) -> None:
    for i, block in enumerate(s.block_table):
        plane[block] = value + i


def test_host_round_trip_restores_evicted_blocks():
    for write_through in (True, False):
        bm, plane = host_manager(num_blocks=4, host_slots=8, write_through=write_through)
        a = seq("a", [1, 2, 3, 4, 5])
        run(bm, a)
        fill(plane, a, 10.0)  # "compute" its KV
        bm.free(a)
        assert bm.stats.num_host_saved_blocks == (2 if write_through else 0)
        other = seq("other", [9, 9, 9, 9, 9, 9, 9])  # needs all 4 blocks: a's two are evicted
        run(bm, other)
        fill(plane, other, 50.0)
        assert bm.stats.num_host_saved_blocks == 2 and bm.stats.num_evicted_blocks == 2
        bm.free(other)
        back = seq("back", [1, 2, 3, 4, 6])
        assert run(bm, back) == 4
        assert bm.stats.num_host_hits == 4 and bm.stats.num_host_loaded_blocks == 2
        assert plane[back.block_table[0]].tolist() == [10.0] * 3  # a's KV came back
        assert plane[back.block_table[1]].tolist() == [11.0] * 3
        bm.free(back)
        bm.check()


def test_full_host_pool_drops_oldest_and_its_descendants():
    bm, plane = host_manager(num_blocks=4, host_slots=2, write_through=False)
    a = seq("a", [1, 2, 3, 4, 5])
    run(bm, a)
    bm.free(a)
    b = seq("b", [6, 7, 8, 9, 10, 11, 0])  # 4 blocks: a's two go to the host pool (now full)
    run(bm, b)
    bm.free(b)
    c = seq("c", [20, 21, 22, 23, 24, 25, 0])  # b's three full blocks are evicted; host keeps the newest
    run(bm, c)
    bm.free(c)
    bm.check()
    assert bm.host.num_used == 2
    assert bm.match(seq("a2", [1, 2, 3, 4, 5])).num_blocks == 0  # a's blocks were dropped from the host pool
    b2 = seq("b2", [6, 7, 8, 9, 0])
    assert run(bm, b2) == 4 and bm.stats.num_host_hits == 4  # b's first two blocks are on the host
    bm.free(b2)
    bm.check()


def test_cached_blocks_counts_leading_content_held_on_the_device():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq("a", list(range(10)))
    run(bm, a)
    assert bm.num_cached_blocks(a) == 0  # nothing registered yet: its own blocks are not in the index
    bm.free(a)
    b = seq("b", [0, 1, 2, 3] + [70, 71, 72, 73, 74])  # block 0 hits; block 1 is new content
    run(bm, b)
    c = seq("c", [50] + list(range(1, 10)))  # block 0 differs
    run(bm, c)
    d = seq("d", list(range(9)))  # computed without a hit below: block 0 hits, block 1 is a's copy
    d.block_table, d.num_computed_tokens = [], 0
    bm.append(d, 9)
    d.num_computed_tokens = 9
    assert (bm.num_cached_blocks(b), bm.num_cached_blocks(c), bm.num_cached_blocks(d)) == (1, 0, 2)
    for s in (b, c, d):
        bm.free(s)
    bm.check()


def test_reset_forgets_device_and_host_blocks_once_none_is_held():
    bm, plane = host_manager(num_blocks=4, host_slots=8, write_through=True)
    a = seq("a", [1, 2, 3, 4, 5])
    run(bm, a)
    assert not bm.reset()  # a holds its blocks: nothing changes
    bm.free(a)
    other = seq("other", [9, 9, 9, 9, 9, 9, 9])  # evicts a's blocks to the host
    run(bm, other)
    bm.free(other)
    assert len(bm.index) == 5 and bm.host.num_used == 5
    assert bm.reset()
    assert len(bm.index) == 0 and bm.host.num_used == 0 and not bm.evictable and bm.num_free_blocks == 4
    bm.check()
    assert run(bm, seq("back", [1, 2, 3, 4, 6])) == 0  # nothing left to hit
