"""Continuous batching: which sequences run this step, and how many tokens each computes."""
from __future__ import annotations

import bisect
from collections import deque
from typing import Callable, Optional

from ..config import SchedulerConfig
from .block_manager import BlockManager
from .prefix_cache import PrefixHit
from .sequence import ScheduledSeq, Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues under a per-step token budget.

    Running sequences go first, in arrival order: each decodes (`decode_shape(seq)` gives the tokens
    it computes and the KV slots it needs: (1, 1) for plain decoding, more to verify draft tokens) or
    continues its prefill in chunks. When the KV pool runs out, the most
    recently admitted running sequence is preempted: its blocks are freed and it is computed again later
    (recompute; its complete blocks stay in the prefix cache while the pool allows). Waiting sequences are
    admitted while the budget, the pool and max_num_seqs allow, starting from the cached blocks their
    tokens begin with. Each running sequence holds a request index below max_num_seqs (`req_index`), its row
    in per-request device buffers, from admission until it finishes or is preempted.

    Under the priority policy both queues are kept in order of (priority, arrival): the most urgent run first
    and are admitted first, and the preempted one is the least urgent running. A waiting request of strictly
    higher priority than the least urgent running one, that cannot be admitted (max_num_seqs reached, or too few
    free blocks for its first chunk), preempts it first (`_make_room`; vLLM issue 40004): equal priorities never
    preempt each other, so no two requests take turns.
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.free_indices = list(range(config.max_num_seqs - 1, -1, -1))
        self.by_priority = config.scheduling_policy == "priority"

    def add(self, seq: Sequence) -> None:
        self._enqueue(self.waiting, seq, True)

    def _enqueue(self, queue, seq: Sequence, last: bool) -> None:
        """Into queue at its place: by (priority, arrival) under the priority policy, else at the end (last)
        or the front."""
        if self.by_priority:
            bisect.insort(queue, seq, key=_urgency)
        elif last:
            queue.append(seq)
        else:
            queue.appendleft(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_pending(self) -> bool:
        """Will the next step compute prompt tokens: a waiting request that may be admitted, or a running
        one with more than its next token to compute (a chunked prompt, a preempted request's recompute)?"""
        if self.waiting and (len(self.running) < self.config.max_num_seqs or self._preempts()):
            return True
        return any(seq.num_uncomputed_tokens > 1 for seq in self.running)

    def prompt_tokens_pending(self) -> int:
        """Prompt tokens the coming steps must compute (0: none; else the next step computes some): the rest
        of running requests' prompts (chunked, or recomputed after preemption) and the prompts of the
        waiting requests that may be admitted."""
        pending = sum(n for seq in self.running  # num_uncomputed_tokens, inlined: each step walks every request
                      if (n := len(seq.token_ids) + seq.num_pending - seq.num_computed_tokens) > 1)
        room = max(self.config.max_num_seqs - len(self.running), int(self._preempts()))
        return pending + sum(seq.num_uncomputed_tokens for _, seq in zip(range(room), self.waiting))

    def schedule(self, decode_shape: Callable[[Sequence], tuple[int, int]] = lambda seq: (1, 1)
                 ) -> list[ScheduledSeq]:
        self._make_room()
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens == 1:
                n, slots = decode_shape(seq)
            else:
                n = slots = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_append(seq, slots):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.blocks.append(seq, slots)
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit, n = self._first_chunk(seq, budget)
            if n is None or not self.blocks.can_admit(seq, hit, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.req_index = self.free_indices.pop()
            self._enqueue(self.running, seq, True)
            self.blocks.admit(seq, hit, n)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _make_room(self) -> None:
        """Priority policy: preempt the least urgent running requests while the most urgent waiting one has a
        strictly higher priority and cannot be admitted."""
        while self._preempts():
            self._preempt(self.running.pop())

    def _preempts(self) -> bool:
        """Priority policy: is the most urgent waiting request strictly more urgent than the least urgent running
        one, and not admissible?"""
        return (self.by_priority and bool(self.waiting) and bool(self.running)
                and self.waiting[0].priority < self.running[-1].priority and not self._admissible(self.waiting[0]))

    def _admissible(self, seq: Sequence) -> bool:
        """Is there a request slot, and are there blocks for seq's first chunk (a full step's budget at most)?"""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        hit, n = self._first_chunk(seq, self.config.max_num_batched_tokens)
        return n is not None and self.blocks.can_admit(seq, hit, n)

    def _first_chunk(self, seq: Sequence, budget: int) -> tuple[PrefixHit, Optional[int]]:
        """The cached blocks seq starts with (computed already) and the tokens it computes on admission within
        `budget` (None: its prompt does not fit and chunked prefill is off)."""
        hit = self.blocks.match(seq)
        n = seq.num_tokens - hit.num_blocks * self.blocks.block_size
        if n > budget and not self.config.enable_chunked_prefill:
            return hit, None
        return hit, min(n, budget)

    def _preempt(self, seq: Sequence) -> None:
        self._release_index(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self._enqueue(self.waiting, seq, False)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
            self._release_index(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def _release_index(self, seq: Sequence) -> None:
        self.free_indices.append(seq.req_index)
        seq.req_index = -1


def _urgency(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival
