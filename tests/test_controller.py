"""The controller's choices on synthetic step-cost and acceptance tables."""
from __future__ import annotations

import random
import statistics

import pytest

from specserve.speculative.controller import Controller
from specserve.speculative.shapes import PLAIN, Shape, candidate_shapes

SHAPES = candidate_shapes(steps=3, topk=1, num_nodes=4)  # plain, chains of 1, 2, 3


def feed(c: Controller, batch: int, cost, accept: float, steps: int = 400, noise: float = 0.0, seed: int = 0,
         catch_up: float = 0.0):
    """Run the controller against a simulated engine: cost(shape) seconds per step, each draft position
    accepted with probability `accept`. As in the engine, a draft step right after plain ones (a catch-up
    over the gap, `catch_up` seconds per plain step missed) is charged but not timed. Returns the shapes
    it chose."""
    rng = random.Random(seed)
    chosen, gap = [], 0
    for _ in range(steps):
        shape = c.choose(batch)
        first = shape != PLAIN and (not chosen or chosen[-1] == PLAIN)
        chosen.append(shape)
        seconds = cost(shape) * (1 + rng.uniform(-noise, noise))
        c.record_step(batch, shape, seconds + (catch_up * gap if first else 0.0), typical=not first,
                      caught_up=batch * gap if first else 0)
        gap = gap + 1 if shape == PLAIN else 0
        if shape.steps:
            for _ in range(batch):
                accepted = 0
                while accepted < shape.steps and rng.random() < accept:
                    accepted += 1
                c.record_verify(shape, accepted)
    return chosen


def true_goodput(shape: Shape, batch: int, cost, accept: float) -> float:
    """Tokens per second of a shape when every draft position is accepted with probability `accept`."""
    return batch * sum(accept ** i for i in range(shape.steps + 1)) / cost(shape)


def regret(chosen: list[Shape], batch: int, cost, accept: float) -> float:
    """1 - the goodput of these steps / the best shape's: the share of serving time lost to choices."""
    best = max(true_goodput(s, batch, cost, accept) for s in SHAPES)
    time = sum(cost(s) for s in chosen)
    tokens = sum(true_goodput(s, batch, cost, accept) * cost(s) for s in chosen)
    return 1 - tokens / time / best


def calibrated(cost, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), noise: float = 0.0, seed: int = 0,
               **options) -> Controller:
    """An adaptive controller seeded with start-up step times: cost(shape, batch) at powers of two."""
    rng = random.Random(seed)
    c = Controller("adaptive", SHAPES, **options)
    c.seed_costs({(n, s): [cost(s, n) * (1 + rng.uniform(-noise, noise)) for _ in range(4)]
                  for n in batches for s in SHAPES})
    return c


def draft_runs(chosen: list[Shape]) -> int:
    """How many times the controller left plain decoding (a probe is one run: a catch-up, then `min_samples`
    timed steps)."""
    return sum(s != PLAIN and (i == 0 or chosen[i - 1] == PLAIN) for i, s in enumerate(chosen))


def settled(chosen: list[Shape]) -> Shape:
    tail = chosen[-100:]
    return max(set(tail), key=tail.count)


def test_plain_when_verify_is_dear_and_acceptance_low():
    c = Controller("adaptive", SHAPES)
    chosen = feed(c, 64, cost=lambda s: 0.010 * (1 + s.k), accept=0.2)  # each draft token costs a full step
    assert settled(chosen) == PLAIN


def test_largest_k_when_verify_is_nearly_free_and_acceptance_high():
    c = Controller("adaptive", SHAPES)
    chosen = feed(c, 1, cost=lambda s: 0.010 * (1 + 0.03 * s.k), accept=0.9)
    assert settled(chosen) == SHAPES[-1]


def test_stable_under_noisy_timings():
    c = Controller("adaptive", SHAPES)
    chosen = feed(c, 8, cost=lambda s: 0.010 * (1 + 0.1 * s.k), accept=0.8, steps=800, noise=0.3)
    tail = chosen[-400:]
    switches = sum(a != b for a, b in zip(tail, tail[1:]))
    # probes come at most every 64 steps (a switch out and back, or two when one cut short by its
    # catch-up step is completed); noise alone must not flip the choice
    assert switches <= 2 * (400 // c.probe_every) + 3
    assert settled(chosen) == SHAPES[-1]


def test_dropped_k_comes_back_when_acceptance_recovers():
    c = Controller("adaptive", SHAPES)
    cost = lambda s: 0.010 * (1 + 0.1 * s.k)  # noqa: E731
    assert settled(feed(c, 4, cost, accept=0.05)) == PLAIN
    assert settled(feed(c, 4, cost, accept=0.95, steps=1500, seed=1)) != PLAIN


def test_threshold_and_always():
    c = Controller("threshold", SHAPES, threshold=8)
    assert c.choose(8) == SHAPES[-1] and c.choose(9) == PLAIN
    assert Controller("always", SHAPES).choose(500) == SHAPES[-1]


def test_probes_stay_within_the_exploration_budget():
    """Each draft token costs a full step and acceptance is low: plain wins. The drafts are probed now
    and then (acceptance could recover), each probe paying a catch-up over the gap; whatever they cost,
    the serving time they lose stays within the budget (2%)."""
    c = Controller("adaptive", SHAPES)
    cost = lambda s: 0.010 * (1 + s.k)  # noqa: E731
    chosen = feed(c, 64, cost=cost, accept=0.2, steps=4000, catch_up=0.0001)
    assert settled(chosen) == PLAIN
    assert 3 <= draft_runs(chosen[500:]) <= 40
    share = c.explain()["buckets"][64]["exploration_loss_share"]
    assert share <= 1.2 * c.exploration_budget, share


def test_an_outlier_step_does_not_flip_the_choice():
    c = Controller("adaptive", SHAPES)
    feed(c, 1, cost=lambda s: 0.010 * (1 + 0.03 * s.k), accept=0.9)
    best = c.current[1]
    c.record_step(1, best, 0.5)  # one step fifty times dearer (a long catch-up, a hiccup of the machine)
    c.choose(1)
    assert c.current[1] == best


def test_a_near_tie_with_plain_goes_to_plain():
    # chain 1 gains 3% over plain (1.6 tokens for 1.55x the time): under the margin, so plain, even when
    # the chain was the choice while acceptance was high
    c = Controller("adaptive", SHAPES[:2])
    cost = lambda s: 0.010 * (1 + 0.55 * s.k)  # noqa: E731
    assert settled(feed(c, 16, cost, accept=0.95)) != PLAIN
    assert settled(feed(c, 16, cost, accept=0.6, steps=1500, seed=1)) == PLAIN


def test_a_slower_machine_does_not_make_unmeasured_drafts_look_cheap():
    # drafts lose clearly at this batch (chain 1 costs 1.8x a plain step for 1.5 tokens); then every step
    # gets 2.5x slower (load, larger batches in the bucket): the drafts' old times must not pass for
    # current ones, or they would win against plain's new ones until probed again
    c = Controller("adaptive", SHAPES)
    cost = lambda s: 0.010 * (1 + 0.8 * s.k)  # noqa: E731
    assert settled(feed(c, 64, cost, accept=0.5)) == PLAIN
    slow = feed(c, 64, lambda s: 2.5 * cost(s), accept=0.5, steps=200, seed=1)
    assert settled(slow) == PLAIN  # drafts run only as probes, each of min_samples steps + the catch-up
    assert sum(s != PLAIN for s in slow) <= draft_runs(slow) * (c.min_samples + 1)


def test_a_batch_that_lost_at_a_smaller_size_is_not_explored_again():
    """Speculation that clearly lost at batch 2 (each draft token costs a full step) is not tried anew when
    the batch grows to 16 and 64: the smaller batch's cost ratio, a hopeful guess, already loses."""
    c = Controller("adaptive", SHAPES)
    feed(c, 2, cost=lambda s: 0.001 * (1 + s.k), accept=0.3, steps=50)
    for batch in (16, 64):
        chosen = feed(c, batch, cost=lambda s: 0.004 * (1 + s.k), accept=0.3, steps=40)
        assert all(s == PLAIN for s in chosen), (batch, chosen)


def test_a_batch_where_speculation_won_smaller_still_explores():
    """The guess only skips shapes that would lose; where the smaller batch's ratio says a draft wins,
    the larger batch measures it."""
    c = Controller("adaptive", SHAPES)
    feed(c, 2, cost=lambda s: 0.001 * (1 + 0.05 * s.k), accept=0.9, steps=50)
    chosen = feed(c, 16, cost=lambda s: 0.004 * (1 + 0.05 * s.k), accept=0.9, steps=40)
    assert any(s != PLAIN for s in chosen[:10])


def test_a_few_early_rejections_deep_in_the_draft_do_not_hold_long_drafts_off():
    """Warm-up verifies rejected position 1 five times in a row; later drafts are accepted 80% of the
    time at every position and a draft token costs a fifth of a step. Position 1 is sampled only while drafts of 2+
    run, so a raw rate would keep the controller at k = 1 for good; pulled toward position 0's rate,
    the longer drafts get tried and win."""
    c = Controller("adaptive", SHAPES)
    for _ in range(5):
        c.record_verify(SHAPES[2], 1)  # position 0 accepted, position 1 rejected
    chosen = feed(c, 1, cost=lambda s: 0.010 * (1 + 0.2 * s.k), accept=0.8, steps=600)
    assert settled(chosen) == SHAPES[-1], settled(chosen)


def test_one_probe_replaces_a_stale_estimate():
    """Chain 3 runs for long (a full window of its times), then for a while costs 5x a plain step and
    loses (a dearer draft looks like a slower machine until the next probe of plain tells them apart);
    when it is cheap again, the next probe's steps replace its stale times and it comes back, rather
    than after the several probes (each twice as far apart) a median of stale times would need."""
    c = Controller("adaptive", SHAPES)
    cheap = lambda s: 0.010 * (1 + 0.3 * s.k)  # noqa: E731
    assert settled(feed(c, 8, cheap, accept=0.9)) == SHAPES[-1]
    assert settled(feed(c, 8, lambda s: 0.010 * (1 + 1.4 * s.k), accept=0.9, steps=300, seed=1)) == PLAIN
    back = feed(c, 8, cheap, accept=0.9, steps=600, seed=2)
    assert settled(back) == SHAPES[-1], back


def test_plain_is_priced_at_the_batch_size_within_a_bucket():
    """A bucket spans batch sizes 65..128, and on a CPU a step's time grows with the batch (here 1 ms per
    request; a chain of k costs 1 + 0.62 k plain steps, so each gains ~1.2x). Plain steps seen while the
    batch grew through 66..98 are read as a line, so drafts measured at batch 120 are compared with plain
    at 120, not with plain's median over the bucket (0.08 s, which would make drafts look 1.5x dearer
    than they are, and lose)."""
    c = Controller("adaptive", SHAPES)
    for n in range(66, 99, 4):
        c.choose(n)
        c.record_step(n, PLAIN, 0.001 * n)
    assert abs(c.step_time[(128, PLAIN)].line(120) - 0.120) < 1e-9
    assert settled(feed(c, 120, lambda s: 0.120 * (1 + 0.62 * s.k), accept=0.9)) != PLAIN


def test_steps_that_compute_prompt_tokens_decode_plain_under_the_adaptive_policy():
    """A step that also computes prompt tokens decodes plain beside them (adaptive), whatever a decode-only
    step would choose; the always policy speculates in every step, as asked."""
    cheap = lambda s, n=None: 0.010 * (1 + 0.05 * s.k)  # noqa: E731
    c = calibrated(cheap)
    c.pin_acceptance([0.8])
    assert c.choose(4) == SHAPES[-1]
    assert c.choose(4, prefill=lambda: True) == PLAIN
    assert Controller("always", SHAPES).choose(4, prefill=lambda: True) == SHAPES[-1]


def test_an_unsampled_tree_is_priced_at_the_chain_of_its_depth():
    """A tree accepts at least what the chain of its depth does (its top-ranked spine is that chain): with
    acceptance forgotten it is priced so, not at one token a step; its verifies then add their gain over
    their spine (here 3 accepted where the spine gave 2: one more token a step)."""
    tree_shapes = candidate_shapes(steps=3, topk=2, num_nodes=6)
    c = Controller("adaptive", tree_shapes)
    c.pin_acceptance([0.8])
    tree, chain = tree_shapes[-1], tree_shapes[-2]
    assert c.expected_tokens(tree) == pytest.approx(c.expected_tokens(chain))
    for _ in range(500):
        c.record_verify(tree, 3, (2, 3))
    assert c.expected_tokens(tree) == pytest.approx(c.expected_tokens(chain) + 1, abs=0.01)


def test_a_tree_is_learned_from_few_verifies_paired_with_its_spine():
    """Each tree verify is a sample of the chain (its spine's drafts) and of the tree's gain over it: 8 verifies
    in which the spine accepts its first draft and not the second, and the tree one more half the time, price
    the chain at 2 tokens (position 1's rate pulled toward 0 by its prior) and the tree at 0.5 x 8 / (8 + 4)
    more; the tree's own total would have moved 8 / (8 + 16) of the way from the chain's."""
    tree_shapes = candidate_shapes(steps=3, topk=2, num_nodes=6)
    c = Controller("adaptive", tree_shapes)
    tree, chain = tree_shapes[-1], tree_shapes[-2]
    for i in range(8):
        c.record_verify(tree, 1 + i % 2, (1, 3))
    rates = c.position_rates()
    assert rates[0] == pytest.approx((8 + 0.5 * 16) / 24) and rates[1] == pytest.approx(rates[0] * 16 / 24)
    assert c.expected_tokens(tree) - c.expected_tokens(chain) == pytest.approx(4 / 12)
    c.record_verify(tree, 2)  # no spine given: nothing learned
    assert c.expected_tokens(tree) - c.expected_tokens(chain) == pytest.approx(4 / 12)


def test_a_trees_gain_hope_is_pulled_toward_its_depth():
    """Worked example (4 pseudo-samples): unsampled, the tree's depth (3); after gains 0 and 1, (0 + 1 + 4 x 3)
    / (2 + 4), where the estimate is (0 + 1) / (2 + 4)."""
    tree_shapes = candidate_shapes(steps=3, topk=2, num_nodes=6)
    c = Controller("adaptive", tree_shapes)
    tree, chain = tree_shapes[-1], tree_shapes[-2]
    assert c.acceptance.gain_hope(tree) == 3.0
    c.record_verify(tree, 2, (2, 3))
    c.record_verify(tree, 2, (1, 3))
    assert c.acceptance.gain_hope(tree) == pytest.approx(13 / 6)
    assert c.acceptance.expected_tokens(tree, hope=True) == pytest.approx(
        c.acceptance.expected_tokens(chain, hope=True) + 13 / 6)
    assert c.expected_tokens(tree) == pytest.approx(c.expected_tokens(chain) + 1 / 6)


def test_a_tree_unlucky_in_its_first_verifies_is_tried_again():
    """The tree always accepts its full depth, a mean gain of 1.05 over its spine (each position 0.8), and wins
    by 17%; but its first three verifies gained nothing, which prices it below chain 2. Probing the
    runner-up by what the tree's gain could still be samples it again, and it is chosen within 400 steps
    (rated by its estimate alone, it waited for its turn as the oldest estimate)."""
    tree_shapes = candidate_shapes(steps=3, topk=2, num_nodes=6)
    tree = tree_shapes[-1]
    cost = lambda s: 0.015 if s.topk > 1 else 0.010 * (1 + 0.1 * s.k)  # noqa: E731
    c = Controller("adaptive", tree_shapes)
    c.seed_costs({(n, s): [cost(s)] * 4 for n in (1, 2, 4) for s in tree_shapes})
    for _ in range(3):
        c.record_verify(tree, 2, (2, 3))
    rng, chosen = random.Random(0), []
    for _ in range(400):
        shape = c.choose(1)
        chosen.append(shape)
        c.record_step(1, shape, cost(shape), typical=True)
        if shape.steps:
            spine = 0
            while spine < shape.steps and rng.random() < 0.8:
                spine += 1
            c.record_verify(shape, shape.steps if shape.topk > 1 else spine, (spine, shape.steps))
    assert settled(chosen) == tree, "".join(str(s.k) for s in chosen)


def test_acceptance_is_learned_first_in_the_shape_it_could_best_be():
    """Start-up costs make a draft token cost half a plain step (a CPU's), so at the prior's 0.5 acceptance
    plain wins. Until 16 verifies have reached the first position, the controller tries the shape that
    would win were the first position's prior 1 (chain 3 at first, shorter chains as verifies pull that
    down): at 0.8 acceptance its first 16 steps draft, and then it speculates on its estimate, instead of
    waiting for probes (2% of the time) to move the prior."""
    cost = lambda s, n=None: 0.018 * (1 + 0.5 * s.k)  # noqa: E731
    c = calibrated(cost, batches=(1,))
    chosen = feed(c, 1, cost, accept=0.8, steps=120)
    assert chosen[0] == SHAPES[-1] and PLAIN not in chosen[:16] and not c.acceptance.young()
    assert chosen[:40].count(PLAIN) <= 3 and settled(chosen) != PLAIN  # chains 1-3 within 4% there
    shy = calibrated(cost, batches=(1,))  # learning off: plain until the probes' verifies move the prior
    shy.acceptance.young = lambda: False
    assert feed(shy, 1, cost, accept=0.8, steps=40).count(PLAIN) >= 30


def test_a_probes_catch_up_is_priced_no_further_than_twice_the_longest_seen():
    """Catch-ups seen so far: 64 pairs at +1 ms, 192 at +3 ms (a line of 1/64 ms a pair through 0). After
    a gap of 1,000 plain steps at batch 64 (64,000 pairs) the next probe is priced at 384 pairs: 6 ms, not
    the 1 s the line would give so far out; that probe's catch-up then teaches the line further."""
    c = Controller("adaptive", SHAPES)
    c.seed_costs({(n, s): [0.01] * 4 for n in (32, 64) for s in SHAPES})
    for pairs, extra in ((64, 1e-3), (192, 3e-3)):
        c.record_step(64, SHAPES[1], 0.01 + extra, typical=False, caught_up=pairs)
    c.plain_steps = 1000
    assert c.catch_up_price(64, 64) == pytest.approx(6e-3, rel=0.05)
    c.plain_steps = 2
    assert c.catch_up_price(64, 64) == pytest.approx(2e-3, rel=0.05)


def test_start_up_times_price_batch_sizes_between_the_measured_ones():
    """Start-up measures batch sizes 1, 2, 4, ..., 128; a batch of 100 (bucket 65..128) is priced on the
    line through 64 and 128, not as 128 (which made plain look dearer at 100 than it is, and a chain timed
    live at 70 cheaper: in the 8B synthetic sweep adaptive chained at C=100, 0.80x plain)."""
    cost = lambda s, n: 0.002 + 0.0001 * n * (1 + 0.5 * s.k)  # noqa: E731
    c = calibrated(cost)
    for shape in SHAPES:
        assert c.seconds(128, shape, 100) == pytest.approx(cost(shape, 100), rel=0.02)


def test_a_machine_that_slows_while_a_draft_runs_gets_the_draft_back_within_bounded_steps():
    """Chain 3 wins (1.6x the time of a plain step for 3.4 tokens); then the machine slows 3x, for every
    shape, while the chain runs and plain is not timed. The chain's slower steps look like a dearer
    chain at first; plain's steps then show the machine slower, the chain comes back and holds."""
    c = Controller("adaptive", SHAPES)
    cost = lambda s: 0.010 * (1 + 0.2 * s.k)  # noqa: E731
    assert settled(feed(c, 1, cost, accept=0.9)) == SHAPES[-1]
    slow = feed(c, 1, lambda s: 3 * cost(s), accept=0.9, steps=400, seed=1)
    back = "".join(str(s.k) for s in slow).index("3" * 20)
    assert back <= 30 and sum(s == SHAPES[-1] for s in slow[back:]) >= 0.9 * len(slow[back:]), back


def test_a_draft_that_grows_dearer_while_it_runs_does_not_make_plain_look_dearer():
    """Chain 3 costs 1.2x a plain step and wins (2.5 tokens at acceptance 0.7); after 100 steps it costs
    3.5x (contexts grew, a server's host work) and every draft loses, while plain costs what it did.
    The chain's steps correct its own estimate, not the machine's speed: plain is chosen and kept."""
    cheap = lambda s, n=None: 0.010 * (1 + 0.067 * s.k)  # noqa: E731
    dear = lambda s: 0.010 * (1 + 0.83 * s.k)  # noqa: E731
    assert all(true_goodput(s, 16, dear, 0.7) < true_goodput(PLAIN, 16, dear, 0.7) for s in SHAPES[1:])
    c = calibrated(cheap)
    c.pin_acceptance([0.7])
    assert settled(feed(c, 16, cheap, accept=0.7, steps=100, noise=0.05)) == SHAPES[-1]
    chosen = feed(c, 16, dear, accept=0.7, steps=600, noise=0.05)
    assert settled(chosen) == PLAIN, "".join(str(s.k) for s in chosen)
    assert regret(chosen[50:], 16, dear, 0.7) <= 0.05


def test_a_probe_cut_short_by_a_catch_up_is_completed():
    """Drafts lost clearly at batch 2, so at batch 16 they are not explored; there they win. A probe's
    first draft step after plain ones pays the catch-up and is not timed, leaving fewer than
    `min_samples` times: the shape is measured to the end, not skipped on the smaller batch's guess."""
    c = Controller("adaptive", SHAPES)
    assert settled(feed(c, 2, cost=lambda s: 0.001 * (1 + 1.5 * s.k), accept=0.9, steps=100)) == PLAIN
    chosen = feed(c, 16, cost=lambda s: 0.004 * (1 + 0.05 * s.k), accept=0.9, steps=600)
    assert settled(chosen) != PLAIN, "".join(str(s.k) for s in chosen)


def test_explain_names_the_choice_its_prediction_and_the_exploration_share():
    c = Controller("adaptive", SHAPES)
    chosen = feed(c, 8, cost=lambda s: 0.010 * (1 + 0.05 * s.k), accept=0.8, steps=600)
    explained = c.explain()
    bucket = explained["buckets"][8]
    assert bucket["k"] == settled(chosen).k == 3
    goodput = bucket["predicted_goodput"]
    assert set(goodput) == {"plain", "chain-1", "chain-2", "chain-3"}
    assert max(goodput, key=goodput.get) == "chain-3"
    assert goodput["plain"] == pytest.approx(8 / 0.010, rel=0.05)  # 8 requests, one token each per 10 ms
    away = sum(s != SHAPES[-1] for s in chosen) / len(chosen)  # steps not on the chosen shape
    assert 0 < bucket["exploration_share"] == pytest.approx(away, abs=0.02)
    assert explained["acceptance_per_position"][0] == pytest.approx(0.8, abs=0.05)
    assert Controller("always", SHAPES).explain()["buckets"] == {}


def test_plain_priced_dear_by_a_slow_spell_is_probed_back_soon():
    """Plain steps run slow for a while (17 ms where start-up measured 7: prompts' work beside them), so a
    chain of 1 wins and plain's price (its start-up time at the speed index its own steps set) stays 2.4x
    too dear once plain is fast again. Its probes are priced at what they could find (the start-up time),
    so one is taken within ~150 steps and plain wins back (read off plain's own dear price, the first
    came after ~650: 600+ steps of an 11% loss, longer than a benchmark level)."""
    def at(plain_ms):
        return lambda s, n=None: plain_ms / 1e3 if s == PLAIN else (7 + 3.8 * s.k + (4 if s.topk > 1 else 0)) / 1e3
    for seed in range(3):
        c = calibrated(at(7))
        assert settled(feed(c, 100, at(17), accept=0.4, steps=300, seed=seed)) != PLAIN
        chosen = feed(c, 100, at(7), accept=0.4, steps=400, seed=100 + seed)
        back = next(i for i in range(len(chosen)) if all(s == PLAIN for s in chosen[i:i + 20]))
        assert back <= 250, (seed, back)


def random_table(rng: random.Random):
    """A step-cost table and acceptance drawn at random: a plain step of 1-20 ms, each draft token adding
    2-150% of it, each draft position accepted with probability 0.2-0.95."""
    base, per_token, accept = rng.uniform(0.001, 0.02), rng.uniform(0.02, 1.5), rng.uniform(0.2, 0.95)
    return (lambda s, n=None: base * (1 + per_token * s.k)), accept


@pytest.mark.parametrize("batch", [1, 8, 64, 200])
@pytest.mark.parametrize("noise, bound", [(0.1, 0.05), (0.2, 0.08)])
def test_with_start_up_costs_the_choice_is_within_5_percent_of_the_best(batch, noise, bound):
    """Random cost and acceptance tables, start-up times and live steps both noisy (each within +-10%):
    over the steps after acceptance is learned (probes and catch-ups included), goodput is within 5% of
    the best shape's; at +-20% noise, where near-ties cannot be told apart in a few steps, within 8%.
    A draft's catch-up costs 0.2% of a plain step per plain step missed (an 8B target's 1-layer draft
    catching up is ~1/32 of a target layer stack); where it costs more, probes out of plain decoding
    are rarer under the same budget and a near-tie the noise tipped to plain is revisited later."""
    rng = random.Random(batch)
    for trial in range(12):
        cost, accept = random_table(rng)
        c = calibrated(cost, noise=noise, seed=trial)
        chosen = feed(c, batch, cost, accept, steps=1500, noise=noise, seed=trial, catch_up=0.002 * cost(PLAIN))
        assert regret(chosen[300:], batch, cost, accept) <= bound, (trial, accept, settled(chosen))


def test_with_start_up_costs_nothing_is_explored_blind():
    """Every shape is priced before the first step: the controller goes straight to the best one."""
    cost = lambda s, n=None: 0.010 * (1 + 0.1 * s.k)  # noqa: E731
    c = calibrated(cost)
    c.pin_acceptance([0.8])
    chosen = feed(c, 16, cost, accept=0.8, steps=50)
    assert all(s == SHAPES[-1] for s in chosen), "".join(str(s.k) for s in chosen)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_a_drifting_machine_keeps_the_best_choice(factor):
    """The machine's speed changes by `factor` for every shape after start-up: live steps of the chosen
    shape set the bucket's speed, the others' start-up times move with it, and the choice stays best."""
    cost = lambda s, n=None: 0.010 * (1 + 0.4 * s.k)  # noqa: E731
    c = calibrated(cost)
    drifted = lambda s: factor * cost(s)  # noqa: E731
    chosen = feed(c, 32, drifted, accept=0.7, steps=1500, noise=0.1, catch_up=0.0001)
    assert regret(chosen[300:], 32, drifted, 0.7) <= 0.05


def test_a_shape_whose_cost_drifts_after_start_up_is_corrected_within_bounded_steps():
    """At start-up chain 3 was cheap and wins; live, it costs 3x more (long contexts make a verify dear)
    and loses to chain 1: its own steps show it at once, and the controller moves off it."""
    cheap = lambda s, n=None: 0.010 * (1 + 0.1 * s.k)  # noqa: E731
    c = calibrated(cheap)
    live = lambda s: 0.010 * (1 + (0.9 if s.k == 3 else 0.1) * s.k)  # noqa: E731
    chosen = feed(c, 8, live, accept=0.6, steps=600, noise=0.1)
    assert SHAPES[-1] not in chosen[60:] or regret(chosen[60:], 8, live, 0.6) <= 0.05
    assert regret(chosen[100:], 8, live, 0.6) <= 0.05


def test_a_step_is_priced_by_the_tokens_it_emits():
    """A verify that accepts more costs more host time (detokenizing, stop checks, KV blocks: ~15 us per
    token on the H200's host). Start-up steps accept almost nothing (random prompts), so their times
    alone make a long chain look cheap at high acceptance: here chain 3 costs 6.3 ms at start-up but
    8.6 ms live at batch 64 (156 more tokens), and plain decoding is the best shape. Priced with the
    start-up's seconds per token, the chain's time is right before it ever runs, and plain is kept."""
    batch, per_token, accept = 64, 15e-6, 0.9
    base = {0: 0.00206, 1: 0.00457, 2: 0.00587, 3: 0.00630}  # at the start-up's one token per request
    tau = 1 + accept + accept ** 2 + accept ** 3

    def seeded(token_seconds: float) -> Controller:
        c = Controller("adaptive", SHAPES)
        c.seed_costs({(n, s): [base[s.k] * n / batch] * 4 for n in (32, 64, 128) for s in SHAPES},
                     tokens={(n, s): [n] * 4 for n in (32, 64, 128) for s in SHAPES}, token_seconds=token_seconds)
        c.pin_acceptance([accept])  # known: the question is the step costs alone
        return c

    chain = SHAPES[-1]
    live = base[3] + per_token * batch * (tau - 1)
    assert seeded(per_token).seconds(batch, chain, batch) == pytest.approx(live, rel=0.01)
    assert seeded(0.0).seconds(batch, chain, batch) < 0.75 * live
    c, rng, chosen = seeded(per_token), random.Random(0), []
    for _ in range(1500):
        shape = c.choose(batch)
        chosen.append(shape)
        accepted = [0] * batch
        for i in range(batch if shape.steps else 0):
            while accepted[i] < shape.steps and rng.random() < accept:
                accepted[i] += 1
        tokens = batch + sum(accepted)
        step = base[shape.k] + per_token * (tokens - batch)
        c.record_step(batch, shape, step * (1 + rng.uniform(-0.05, 0.05)), tokens=tokens)
    assert sum(s == PLAIN for s in chosen[300:]) >= 0.95 * 1200


def test_one_odd_plain_step_does_not_reprice_the_bucket():
    """On the H200 (8B shape, C=250) the first decode-only step after a run of prefill steps took 35.6 ms
    where plain's start-up time was 8 ms; read alone, it made plain look 3.7x dearer, and a chain that
    loses to plain was chosen for the rest of the level. One odd step must not move the speed index;
    a real drift (three steps in a row) still does."""
    cost = lambda s, n=None: 0.008 * (1 + 0.7 * s.k)  # noqa: E731
    c = calibrated(cost)
    c.pin_acceptance([0.4])
    assert c.choose(250) == PLAIN
    c.record_step(250, PLAIN, 0.008)  # plain's window of times is full: its steps now move the speed index
    c.record_step(250, PLAIN, 0.0356)
    assert c.seconds(256, PLAIN, 250) == pytest.approx(cost(PLAIN), rel=0.01)
    assert c.choose(250) == PLAIN
    for _ in range(2):
        c.record_step(250, PLAIN, 0.016)
    assert c.seconds(256, PLAIN, 250) == pytest.approx(0.016, rel=0.01)


def test_a_step_with_a_prompt_speculates_where_its_added_tokens_come_cheap():
    """Worked example on the H200's figures (8B shape; session 13 trace): beside a prompt a step runs
    eagerly, and its verify tokens add compute to a step the prompt made compute-bound. At batch 8 the
    decode-only steps pay 0.28 ms a token, and a chain of 3 adds 15.6 tokens for 3.5 ms over a plain
    step with the prompt: it keeps the chain. At batch 128 decode-only tokens cost 0.042 ms, and a chain
    of 1 adds 102 tokens for 11 ms (0.11 ms each): it decodes plain there. Unmeasured, a prompt step
    decodes plain."""
    decode = {8: {0: 5.2, 1: 5.8, 2: 6.3, 3: 6.7}, 128: {0: 6.64, 1: 9.64, 2: 14.0, 3: 20.9}}
    over_plain = {8: {1: 2.0, 2: 2.8, 3: 3.5}, 128: {1: 11.0, 2: 17.0, 3: 28.0}}
    times = {(n, s): [decode[n][s.k] * 1e-3] * 4 for n in decode for s in SHAPES}
    extra = {(n, s): [over_plain[n][s.k] * 1e-3] * 2 for n in over_plain for s in SHAPES if s.k}
    c = Controller("adaptive", SHAPES)
    c.seed_costs(times, prompt_extra=extra)
    c.pin_acceptance([0.8])
    assert c.choose(8) == SHAPES[3] and c.choose(8, prefill=lambda: True) == SHAPES[3]
    assert c.choose(128) == SHAPES[1] and c.choose(128, prefill=lambda: True) == PLAIN
    assert c.choose(128, prefill=lambda: False) == SHAPES[1]
    assert c.explain()["buckets"][8]["k_beside_prompt"] == 3
    assert c.explain()["buckets"][128]["k_beside_prompt"] == 0
    unmeasured = Controller("adaptive", SHAPES)
    unmeasured.seed_costs(times)
    unmeasured.pin_acceptance([0.8])
    assert unmeasured.choose(8) == SHAPES[3] and unmeasured.choose(8, prefill=lambda: True) == PLAIN


def test_a_prompt_steps_extra_cost_is_read_through_its_familys_line():
    """Start-up samples what a draft's step with a prompt costs over a plain one, 3 times per shape and batch
    size, each off by up to 3 ms (here around 2 ms + 20 us per verify token added; one sample took 0.7 s, a
    kernel compile): the line through all of them prices every shape and size within 1.2 ms, where their
    own three samples' median is off by over 2 ms somewhere; beyond twice the largest size measured nothing
    is priced."""
    chains = candidate_shapes(steps=5, topk=1, num_nodes=6)
    truth = lambda n, s: 2e-3 + 20e-6 * n * s.k  # noqa: E731
    rng = random.Random(1)
    extra = {(n, s): [truth(n, s) + rng.uniform(-3e-3, 3e-3) for _ in range(3)]
             for n in (1, 2, 4, 8, 16, 32, 64) for s in chains[1:]}
    extra[(8, chains[-1])][0] = 0.7
    c = Controller("adaptive", chains)
    c.seed_costs({(n, s): [0.005 * (1 + 0.05 * s.k)] * 4 for n in (1, 8, 64) for s in chains}, prompt_extra=extra)
    fit = max(abs(c.prompt_extra(s, n) - truth(n, s)) for n, s in extra)
    own = max(abs(statistics.median(v) - truth(n, s)) for (n, s), v in extra.items())
    assert fit < 1.2e-3 and own > 2e-3, (fit, own)
    assert c.prompt_extra(chains[-1], 129) is None and c.prompt_extra(PLAIN, 8) == pytest.approx(2e-3, abs=0.5e-3)


def test_verify_tokens_that_push_prompt_tokens_out_of_the_step_are_charged():
    """At batch 250 a chain of 2 adds 500 verify tokens. With 300 prompt tokens waiting they fit beside
    the prompt in a 2048-token step, and the chain is kept (its measured extra, 9 ms, buys 427 tokens that
    decode-only steps make at 27 us each). With 4,000 waiting the step is full of prompt tokens: 500 of
    them move to a later step at 24 us each (12 ms more), and the step decodes plain."""
    chain2 = Shape(2, 1, 3)
    shapes = [PLAIN, Shape(1, 1, 2), chain2]
    decode = {PLAIN: 8.0, shapes[1]: 13.5, chain2: 18.0}
    c = Controller("adaptive", shapes, token_budget=2048)
    c.seed_costs({(n, s): [decode[s] * 1e-3] * 4 for n in (128, 250) for s in shapes},
                 prompt_extra={(250, s): [9e-3] * 3 for s in shapes[1:]}, prompt_token_seconds=24e-6)
    c.pin_acceptance([0.9, 0.9])
    assert c.choose(250) == chain2
    assert c.choose(250, prefill=lambda: 300) == chain2
    assert c.choose(250, prefill=lambda: 4000) == PLAIN
    assert c.choose(250, prefill=lambda: 0) == chain2  # nothing waiting: a decode-only step
