"""The scheduler on its own: token budget, chunked prefill, admission limits, preemption order."""
from __future__ import annotations

from specserve.config import SchedulerConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.sampling_params import SamplingParams

BLOCK = 4


def make(num_blocks: int = 64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, BLOCK, enable_prefix_caching=False))


def request(name: str, prompt_len: int, priority: int = 0, arrival: int = 0) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), set(), 4096, None,
                    priority=priority, arrival=arrival)


def run(batch) -> list[tuple[str, int]]:
    """Apply a step as the engine would (the KV is computed; a sampling item gains a token)."""
    for item in batch:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_tokens
        if samples:
            item.seq.token_ids.append(7)
    return [(item.seq.request_id, item.num_tokens) for item in batch]


def test_running_decodes_first_then_a_prompt_chunked_to_the_budget():
    s = make(max_num_batched_tokens=8)
    for name in ("a", "b"):
        s.add(request(name, 3))
    assert run(s.schedule()) == [("a", 3), ("b", 3)]  # both prompts fit in 8
    s.add(request("c", 20))
    assert run(s.schedule()) == [("a", 1), ("b", 1), ("c", 6)]  # decodes, then 8 - 2 of c's prompt
    assert run(s.schedule()) == [("a", 1), ("b", 1), ("c", 6)]
    assert run(s.schedule()) == [("a", 1), ("b", 1), ("c", 6)]
    assert run(s.schedule()) == [("a", 1), ("b", 1), ("c", 2)]  # the prompt's last 2 tokens
    assert run(s.schedule()) == [("a", 1), ("b", 1), ("c", 1)]  # c decodes


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add(request("a", 3))
    run(s.schedule())
    s.add(request("b", 8))
    assert run(s.schedule()) == [("a", 1)]  # 7 tokens left: b's 8 do not fit, and are not split
    assert [q.request_id for q in s.waiting] == ["b"]


def test_admission_stops_at_max_num_seqs_in_arrival_order():
    s = make(max_num_seqs=2)
    for name in "abc":
        s.add(request(name, 2))
    assert run(s.schedule()) == [("a", 2), ("b", 2)]
    assert [q.request_id for q in s.waiting] == ["c"]
    s.finish(s.running[0])
    assert run(s.schedule()) == [("b", 1), ("c", 2)]


def test_the_latest_admitted_is_preempted_when_the_pool_runs_out():
    s = make(num_blocks=3)
    for name in ("a", "b", "c"):
        s.add(request(name, BLOCK))  # one full block each: the pool is full
    run(s.schedule())
    assert s.blocks.num_free_blocks == 0
    batch = s.schedule()  # each decode needs a new block: c (admitted last) goes, then b
    assert [item.seq.request_id for item in batch] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b", "c"]  # preempted ones wait first, in order
    assert s.num_preemptions == 2
    for name in "bc":
        victim = next(q for q in s.waiting if q.request_id == name)
        assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
        assert victim.block_table == []


def test_priority_orders_admission_and_the_running_queue():
    s = make(max_num_seqs=2, scheduling_policy="priority")
    for i, (name, priority) in enumerate([("a", 5), ("b", 0), ("c", 1), ("d", 0)]):
        s.add(request(name, 2, priority, i))
    assert run(s.schedule()) == [("b", 2), ("d", 2)]  # the most urgent first, equal ones by arrival
    assert [q.request_id for q in s.waiting] == ["c", "a"]
    s.add(request("e", 2, -1, 4))
    s.finish(s.running[0])
    assert run(s.schedule()) == [("d", 1), ("e", 2)]  # e, more urgent than any, is admitted first ...
    assert [q.request_id for q in s.running] == ["e", "d"]  # ... and runs first from then on
    assert run(s.schedule()) == [("e", 1), ("d", 1)]


def test_priority_preempts_the_least_urgent_and_requeues_it_by_urgency():
    s = make(num_blocks=3, scheduling_policy="priority")
    for i, (name, priority) in enumerate([("a", 2), ("b", 0), ("c", 1)]):
        s.add(request(name, BLOCK, priority, i))
    run(s.schedule())
    s.add(request("d", 2, 1, 3))  # waits: no block left for it
    batch = s.schedule()  # each decode needs a new block: a (the least urgent), then c go
    assert [item.seq.request_id for item in batch] == ["b"]
    assert [q.request_id for q in s.waiting] == ["c", "d", "a"]  # by (priority, arrival)
    fcfs = make(num_blocks=3)
    for i, (name, priority) in enumerate([("a", 2), ("b", 0), ("c", 1)]):
        fcfs.add(request(name, BLOCK, priority, i))
    run(fcfs.schedule())
    assert [item.seq.request_id for item in fcfs.schedule()] == ["a"]  # first come, first served


def test_a_strictly_more_urgent_arrival_preempts_for_a_slot_or_for_blocks():
    s = make(max_num_seqs=2, scheduling_policy="priority")
    for i, (name, priority) in enumerate([("a", 2), ("b", 1)]):
        s.add(request(name, 2, priority, i))
    run(s.schedule())
    s.add(request("c", 2, 2, 2))  # a's priority: waits for a slot
    assert run(s.schedule()) == [("b", 1), ("a", 1)] and s.num_preemptions == 0
    assert not s.prefill_pending() and s.prompt_tokens_pending() == 0  # c waits without a prompt step
    s.add(request("d", 2, 0, 3))  # more urgent than a, the least urgent running one: takes its slot
    assert s.prefill_pending() and s.prompt_tokens_pending() == 2
    assert run(s.schedule()) == [("b", 1), ("d", 2)] and s.num_preemptions == 1
    assert [q.request_id for q in s.waiting] == ["a", "c"]
    blocks = make(num_blocks=2, scheduling_policy="priority")
    blocks.add(request("x", BLOCK - 1, 1, 0))
    blocks.add(request("y", BLOCK - 1, 2, 1))
    run(blocks.schedule())  # one block each: the pool is full
    blocks.add(request("z", 3, 0, 2))  # a slot is free but no block: y, the least urgent, makes room
    assert run(blocks.schedule()) == [("x", 1), ("z", 3)] and [q.request_id for q in blocks.waiting] == ["y"]


def test_prefill_pending_names_the_steps_that_will_compute_prompt_tokens():
    """What the adaptive controller decodes plain beside: an admissible waiting request, or a running one
    whose prompt is still being chunked in."""
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    assert not s.prefill_pending()
    s.add(request("a", 3))
    assert s.prefill_pending()  # waiting, and room to admit it
    run(s.schedule())
    assert not s.prefill_pending()  # a decodes
    s.add(request("b", 20))
    assert s.prefill_pending()
    run(s.schedule())  # b admitted, 7 of its 20 prompt tokens computed
    assert s.prefill_pending()  # b's prompt continues
    while any(seq.num_uncomputed_tokens > 1 for seq in s.running):
        run(s.schedule())
    s.add(request("c", 3))
    assert not s.prefill_pending()  # c waits, but two requests already run: it cannot be admitted


def test_prompt_tokens_pending_counts_what_the_coming_steps_must_prefill():
    """The rest of a chunked prompt and the prompts of the waiting requests that may be admitted (not
    those beyond max_num_seqs); 0 once every running request decodes."""
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    s.add(request("a", 3))
    s.add(request("b", 20))
    s.add(request("c", 5))
    assert s.prompt_tokens_pending() == 3 + 20  # c waits beyond max_num_seqs
    run(s.schedule())  # a's 3, b's first 5
    assert s.prompt_tokens_pending() == 15 and s.prefill_pending()
    while s.prompt_tokens_pending():
        run(s.schedule())
    assert not s.prefill_pending()
