"""The host tier: copies of KV blocks in (pinned) host memory, saved and loaded by block.

The pool mirrors the device pool's *planes*: every tensor indexed by block id, viewed block-first
([num_blocks, ...]): the target's KV, the draft's KV, the draft's per-block features. A host slot holds
one block of every plane ([num_slots, ...] each, one contiguous region per slot).

On CUDA the copies run on a side stream: a save gathers the blocks on the current stream (so they may be
overwritten right after) and copies them to pinned memory on the side stream while compute goes on; a
load copies on the side stream and makes the current stream wait for it, so the CPU keeps preparing the
step while the copy runs. Every copy goes through the one side stream, in issue order, so reusing a
slot is always ordered after its last copy. On CPU the copies are plain tensor copies.
"""
from __future__ import annotations

import os
from collections import OrderedDict, deque
from typing import Callable, Iterator, Optional

import torch

from ..config import CacheConfig
from .prefix_cache import CachedBlock


class HostPool:
    def __init__(self, planes: list[torch.Tensor], num_slots: int):
        self.planes = planes  # block-first views of the device tensors, [num_blocks, ...] each
        self.device = planes[0].device
        self.num_slots = num_slots
        cuda = self.device.type == "cuda"
        # [num_slots, ...] per plane, pinned so that copies are asynchronous DMA
        self.host = [torch.empty((num_slots, *p.shape[1:]), dtype=p.dtype, pin_memory=cuda) for p in planes]
        self.free_slots: deque[int] = deque(range(num_slots))
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(self.device) if cuda else None

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_slots

    def alloc(self) -> Optional[int]:
        return self.free_slots.popleft() if self.free_slots else None

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def save(self, blocks: list[int], slots: list[int]) -> None:
        """Copy device blocks to host slots; the blocks may be reused as soon as this returns."""
        if not blocks:
            return
        if self.stream is None:
            index = torch.tensor(blocks)
            for plane, host in zip(self.planes, self.host):
                host[slots] = plane[index]
            return
        main = torch.cuda.current_stream(self.device)
        index = torch.tensor(blocks, device=self.device)
        staged = [plane[index].contiguous() for plane in self.planes]  # [n, ...] gathered on the main stream
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for part, host in zip(staged, self.host):
                part.record_stream(self.stream)  # keep the staging memory until the copy is done
                for i, j, slot in _runs(slots):
                    host[slot:slot + j - i].copy_(part[i:j], non_blocking=True)

    def load(self, slots: list[int], blocks: list[int]) -> None:
        """Copy host slots into device blocks; work issued afterwards on the current stream sees them."""
        if not blocks:
            return
        if self.stream is None:
            index = torch.tensor(blocks)
            for plane, host in zip(self.planes, self.host):
                plane[index] = host[slots]
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the blocks' previous users are done with them
        with torch.cuda.stream(self.stream):
            index = torch.tensor(blocks, device=self.device)
            for plane, host in zip(self.planes, self.host):
                staged = torch.empty((len(blocks), *plane.shape[1:]), dtype=plane.dtype, device=self.device)
                for i, j, slot in _runs(slots):
                    staged[i:j].copy_(host[slot:slot + j - i], non_blocking=True)
                plane[index] = staged
        main.wait_stream(self.stream)


class HostTier:
    """Which cached blocks have a copy in the host pool, least recently used first, and their copies.

    Taking a slot from a full pool drops the oldest copy; a block then left in neither pool is dropped
    from the prefix index through `drop` (the block manager's).
    """

    def __init__(self, pool: HostPool, write_through: bool, drop: Callable[[CachedBlock], None]):
        self.pool = pool
        self.write_through = write_through  # copy blocks when they are cached, not when they are evicted
        self.lru: OrderedDict[CachedBlock, None] = OrderedDict()
        self.drop = drop

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    @property
    def usage(self) -> float:
        return self.pool.usage

    def touch(self, node: CachedBlock) -> None:
        if node.host_slot is not None:
            self.lru.move_to_end(node)

    def save(self, nodes: list[CachedBlock], alive: Callable[[CachedBlock], bool]) -> int:
        """Copy device-resident nodes to host slots, as many as find one; returns how many."""
        saved: list[CachedBlock] = []
        for node in nodes:
            slot = self._slot()
            if slot is None:
                break
            if not alive(node):  # dropped with its prefix to free that slot
                self.pool.release(slot)
                continue
            node.host_slot = slot
            self.lru[node] = None
            saved.append(node)
        self.pool.save([n.block for n in saved], [n.host_slot for n in saved])
        return len(saved)

    def pin(self, nodes: list[CachedBlock]) -> None:
        """Keep these copies while device blocks are found for them (evictions may need host slots)."""
        for node in nodes:
            del self.lru[node]

    def load(self, nodes: list[CachedBlock], blocks: list[int]) -> None:
        """Copy pinned nodes back into device blocks, and unpin them."""
        self.pool.load([n.host_slot for n in nodes], blocks)
        for node in reversed(nodes):  # a prefix is used at least as recently as what follows it
            self.lru[node] = None

    def forget(self, node: CachedBlock) -> None:
        """node leaves the prefix index: free its copy."""
        if node.host_slot is not None:
            del self.lru[node]
            self.pool.release(node.host_slot)
            node.host_slot = None

    def _slot(self) -> Optional[int]:
        slot = self.pool.alloc()
        while slot is None and self.lru:
            node, _ = self.lru.popitem(last=False)
            slot, node.host_slot = node.host_slot, None
            if node.block is None:
                self.drop(node)
        return slot

    def check(self, nodes: list[CachedBlock]) -> None:
        """Assert that exactly these nodes hold host slots, each its own, and no slot leaked."""
        slots = {n.host_slot for n in nodes}
        assert len(slots) == len(nodes) == len(self.lru) and all(n in self.lru for n in nodes), "host LRU is stale"
        assert len(slots) + len(self.pool.free_slots) == self.pool.num_slots, "host slots leaked"


def _runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of consecutive slots: (start, end) into the list and the first slot."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, j, slots[i]
        i = j


def block_bytes(planes: list[torch.Tensor]) -> int:
    return sum(p[0].numel() * p.element_size() for p in planes)


def host_pool_slots(cache: CacheConfig, planes: list[torch.Tensor], num_device_blocks: int) -> int:
    """Host slots the configuration asks for (0 = no host tier).

    Explicit sizes are honoured (on CPU too, where the host tier is only useful for tests); the default
    is one device pool's worth on CUDA, at most a quarter of the host memory free now, and none on CPU.
    """
    if not cache.enable_prefix_caching:
        return 0
    per_block = block_bytes(planes)
    if cache.kv_host_size_gb is not None:
        return int(cache.kv_host_size_gb * 2**30 // per_block)
    if cache.kv_host_ratio is not None:
        return int(cache.kv_host_ratio * num_device_blocks)
    if planes[0].device.type != "cuda":
        return 0
    free_host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(num_device_blocks, int(free_host // 4 // per_block))
