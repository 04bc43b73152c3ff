"""How much to speculate, chosen before every step.

A *shape* is what one verify looks like: (draft steps, children per node, tokens verified incl. the
root). Shape 0 is plain decoding: no draft forward, no verify machinery, no lookahead KV. Chains of
1..S steps and, when a tree is configured, the tree itself are the other candidates.

Policies:
- always: the configured shape every step;
- threshold: plain decoding while more than `threshold` requests run, else the configured shape;
- adaptive: the shape with the most expected tokens per second for the running batch. Expected tokens
  per request come from live acceptance (speculative/acceptance.py: per-position conditional rates for
  chains, learned from chain verifies and from the spines of tree verifies; a tree as the chain of its
  depth plus its mean gain over its spine; pooled over batch sizes: acceptance does not depend on the
  batch). Until a few verifies have taught it (`Acceptance.young`), the steps try the shape that would
  win at the most hopeful acceptance, so a prior that favours plain decoding is not left to the probes
  to correct (on a CPU, where drafts are dear, the prior held plain through a whole benchmark). Step times (drafting,
  catching up and verifying included) are measured at start-up for every shape at batch sizes 1, 2, 4,
  ... (`seed_costs`, speculative/calibration.py) and then refreshed from live steps, the latest `window`
  of each per (batch-size bucket, shape), read per batch size (`StepTimes`; a median shrugs off noise).
  Shapes are measured at different times while the machine's speed drifts, so times are kept at a
  per-bucket speed index that plain decoding's steps track (`record_step`): plain is the anchor every
  draft is priced against, and a draft's own steps refine only its own estimate (a draft dearer live
  than measured at start-up, on long contexts or beside a server's host work, must not make plain
  look dearer too).
  A step that also computes prompt tokens runs eagerly and synchronously beside the prefill, outside the
  overlapped loop, and its verify tokens add compute to a step the prompt made compute-bound: its
  price is not a decode-only step's. Start-up measures what a draft shape's step with a prompt costs
  over a plain one (`prompt_extra`: a robust line per draft family in the verify tokens it adds, as
  one sample is noisy), and such a step keeps the bucket's choice only when the tokens
  speculation adds there cost less than the bucket's decode-only steps pay per token (they would make
  those tokens later); else it decodes plain (as SGLang speculates only in decode batches). Where
  prompts fill the step's token budget, its verify tokens also push prompt tokens to later steps,
  which is charged too. On the H200, 8B shape, the tokens a chain added beside a prompt cost 69-112 us
  each at C = 70-250, where decode-only steps made them at 47-59 us, and little at C = 5-10 where a
  decode-only token cost 200 us. Only decode-only steps are timed live.
  A switch needs a clear gain (hysteresis), a draft is chosen only while it clearly beats plain
  decoding (near-ties go to plain), and the shape whose estimate is oldest is probed so a dropped one
  can come back and acceptance is sampled while plain runs: `min_samples` steps whose times replace its
  estimate, at most every `probe_every` steps and only while the bucket's exploration credit covers
  the probe's price. Each step earns `exploration_budget` (2%) of its time as credit, and a step away
  from the chosen shape is charged what it lost against it (a draft's catch-up after plain steps
  included), so exploring costs at most that share of serving time, whatever the workload.
  Without a start-up table (shapes unmeasured in a bucket), shapes are tried in order of size until a
  larger one has clearly lost (or, guessed from the cost ratio measured at a smaller batch, would
  clearly lose).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

from .acceptance import Acceptance
from .estimates import Recent, StepTimes, robust_line
from .shapes import PLAIN, Shape, bucket


class Controller:
    def __init__(self, policy: str, shapes: list[Shape], threshold: int = 32, hysteresis: float = 0.03,
                 probe_every: int = 64, acceptance_window: int = 512, min_samples: int = 3, window: int = 9,
                 prior_samples: int = 16, speed_window: int = 5, exploration_budget: float = 0.02,
                 token_budget: int = 2048):
        """token_budget: the tokens one step may compute (SchedulerConfig.max_num_batched_tokens)."""
        if policy not in ("always", "threshold", "adaptive"):
            raise ValueError(f"unknown speculative policy {policy!r}")
        self.policy = policy
        self.shapes = shapes
        self.configured = shapes[-1]
        self.threshold = threshold
        self.hysteresis = hysteresis
        self.probe_every = probe_every
        self.min_samples = min_samples
        self.window = window
        self.exploration_budget = exploration_budget
        self.speed_window = speed_window
        self.implied_speed: dict[int, Recent] = {}  # per bucket: speeds implied by plain's latest steps
        # per bucket: per draft shape, its latest times taken since plain last ran (`_reanchor`), and
        # the plain steps since the last draft step
        self.unanchored: dict[int, dict[Shape, int]] = {}
        self.plain_since: dict[int, int] = {}
        self.step_time: dict[tuple[int, Shape], StepTimes] = {}  # (bucket, shape): at the speed index 1
        self.start_up: dict[tuple[int, Shape], StepTimes] = {}  # (bucket, shape): the start-up table's, kept
        self.acceptance = Acceptance(max(s.steps for s in shapes), acceptance_window, prior_samples)
        self.changes = 0  # observations that can move a decision (times of shapes not running, acceptance)
        self.current: dict[int, Shape] = {}
        self.decided_on: dict[int, tuple[int, int]] = {}  # per bucket: (batch size, changes) of its last decision
        self.next_probe: dict[int, int] = {}  # per bucket: the step count from which it may probe again
        self.credit: dict[int, float] = {}  # per bucket: seconds of serving time it may still lose exploring
        self.catch_ups: deque[tuple[float, float]] = deque(maxlen=16)  # (pairs caught up, seconds over a step)
        self.plain_steps = 0  # decode steps since the last one that drafted (its catch-up grows with them)
        self.probes: dict[int, int] = {}  # per bucket: probes made (every second one goes to the runner-up)
        self.probing: dict[int, list[Shape]] = {}  # per bucket: the probe's steps still to take
        self.stale: set[tuple[int, Shape]] = set()  # probed, and the old estimate not yet replaced
        self.last_sample: dict[tuple[int, Shape], int] = {}  # (bucket, shape): the record that last timed it
        self.records = 0
        self.steps_taken = 0
        self.decided: dict[int, int] = {}  # per bucket: adaptive decisions made
        self.explored: dict[int, int] = {}  # per bucket: of them, steps of a shape other than the best (tries, probes)
        self.predicted: dict[int, dict[Shape, float]] = {}  # per bucket: goodput of each measured shape, last decision
        self.decided_at: dict[int, int] = {}  # per bucket: the batch size of its last decision
        # per draft family (topk): (seconds, per verify token added) that a step with a prompt costs over a
        # plain one (start-up, speed index 1), up to batch size `prompt_batch`; see `prompt_extra`
        self.prompt_lines: dict[int, tuple[float, float]] = {}
        self.prompt_batch = 0
        self.beside: dict[int, Shape] = {}  # per bucket: the shape of its latest step with a prompt
        self.token_budget = token_budget
        self.prompt_token_seconds = 0.0  # what a prompt token costs to compute (start-up)
        self.calibration: Optional[dict] = None  # what the start-up measurement found and cost (for explain)
        # host seconds per token a step emits (detokenizing, stop checks, KV blocks: a verify that accepts
        # more costs more); step times are kept without it and priced with each shape's expected tokens
        self.token_seconds = 0.0
        self.serving_time: dict[int, float] = {}  # per bucket: seconds of decode steps recorded
        self.exploration_loss: dict[int, float] = {}  # per bucket: of them, seconds lost to other shapes

    # ---- decisions ----------------------------------------------------------------------------
    def choose(self, batch_size: int, prefill: Optional[Callable[[], int]] = None) -> Shape:
        """The shape of the next step for batch_size running requests; prefill(): the prompt tokens waiting to
        be computed (0: none; else the step computes some, see the module docstring for the adaptive
        policy's choice beside them). Asked only by that policy."""
        if self.policy == "always":
            return self.configured
        if self.policy == "threshold":
            return PLAIN if batch_size > self.threshold else self.configured
        pending = prefill() if prefill is not None else 0
        if pending:
            return self._beside_prompt(bucket(batch_size), batch_size, pending)
        return self._adaptive(bucket(batch_size), batch_size)

    def _beside_prompt(self, b: int, batch_size: int, pending: int) -> Shape:
        """A step with `pending` prompt tokens waiting: the bucket's choice if the tokens it adds over plain
        decoding there cost less (hysteresis included) than the bucket's decode-only steps pay per token,
        else plain (also while the bucket has no choice, or start-up did not measure the choice beside a
        prompt). The cost added: what start-up measured, and the prompt tokens its verify tokens push out of
        the step's token budget, at what a prompt token costs (they are computed in a later step)."""
        best = self.current.get(b)
        self.beside[b] = PLAIN
        extra = None if best is None or best == PLAIN else self.prompt_extra(best, batch_size)
        if extra is None or not self._priced(b, best):
            return PLAIN
        per_token = self.seconds(b, best, batch_size) / (batch_size * self.expected_tokens(best))
        verify = batch_size * (best.num_nodes - 1)  # tokens over plain decoding's one per request
        displaced = max(0, min(verify, pending + verify - (self.token_budget - batch_size)))
        added = self.speed(b) * (extra + displaced * self.prompt_token_seconds)
        gained = batch_size * (self.expected_tokens(best) - 1.0)
        if added * (1 + 2 * self.hysteresis) < gained * per_token:
            self.beside[b] = best
        return self.beside[b]

    def prompt_extra(self, shape: Shape, batch_size: int) -> Optional[float]:
        """Seconds (speed index 1) a step of this draft shape with a prompt costs over a plain one, on the
        robust line start-up's samples of its family gave in the verify tokens it adds (batch size x draft
        tokens); None beyond the batch sizes measured. One sample is the difference of two windows of
        steps (tens of ms around a prefill): per shape and size it scattered by +-3 ms on the H200, and
        the median of three flipped steps with a prompt to plain at C = 5-10 (0.94 / 0.90 of the best
        fixed shape in the 8B sweep, shipped profile)."""
        line = self.prompt_lines.get(shape.topk)
        if line is None or batch_size > self.prompt_batch:
            return None
        return line[0] + line[1] * batch_size * (shape.num_nodes - 1)

    def _adaptive(self, b: int, batch_size: int) -> Shape:
        self.steps_taken += 1
        self.decided[b] = self.decided.get(b, 0) + 1
        if self.probing.get(b):
            return self._explore(b, self.probing[b].pop())
        key = (batch_size, self.changes)  # nothing the choice depends on changed (a uniform speed-up does not)
        if self.decided_on.get(b) == key and b in self.current:
            best = self.current[b]
            shape = self._maybe_probe(b, best, batch_size)
            return shape if shape == best else self._explore(b, shape)
        measured = []
        for shape in self.shapes:  # explore in order of cost; stop once a larger shape already lost
            if not self._priced(b, shape):
                if measured and not self._samples(b, shape):  # not begun: skip it if even a hope loses
                    hope = self.goodput(b, measured[-1], batch_size)  # the last priced shape's
                    if hope * (1 + 2 * self.hysteresis) < max(self.goodput(b, m, batch_size) for m in measured):
                        break
                return self._explore(b, shape)
            measured.append(shape)
        scores = {s: self.goodput(b, s, batch_size) for s in measured}
        best = max(scores, key=scores.get)
        current = self.current.get(b, best)
        if current in scores and scores[best] < scores[current] * (1 + self.hysteresis):
            best = current
        # plain decoding is the default a draft must beat clearly, to be entered (it pays a catch-up over
        # the gap) and to be kept (its steps cannot overlap the host's work; near-ties lose to noise)
        margin = self.hysteresis * (2 if current == PLAIN else 1)
        if best != PLAIN and PLAIN in scores and scores[best] < scores[PLAIN] * (1 + margin):
            best = PLAIN
        self.current[b] = best
        self.predicted[b] = scores
        self.decided_at[b] = batch_size
        self.decided_on[b] = key
        if self.acceptance.young():  # learn acceptance first, in the shape it could best be
            hope = max(measured, key=lambda s: self.goodput(b, s, batch_size, hope=True))
            if hope != best:
                return self._explore(b, hope)
        shape = self._maybe_probe(b, best, batch_size)
        return shape if shape == best else self._explore(b, shape)

    def _explore(self, b: int, shape: Shape) -> Shape:
        self.explored[b] = self.explored.get(b, 0) + 1
        return shape

    def explain(self) -> dict:
        """Why the controller speculates as it does, for /server_info and /metrics: the acceptance per
        draft position, and per batch bucket the shape chosen (its k), the goodput (tokens/s) predicted for
        each measured shape at the latest decision and the batch size it was made at, the bucket's speed
        index, and the share of steps spent exploring other shapes.
        Read from another thread while the engine runs: a read that races an update is retried."""
        for _ in range(3):
            try:
                return self._explain()
            except RuntimeError:  # a window or dict changed size while it was read
                continue
        return {"policy": self.policy}

    def _explain(self) -> dict:
        current, predicted, decided, explored, beside = (dict(d) for d in (self.current, self.predicted, self.decided,
                                                                           self.explored, self.beside))
        served, lost = dict(self.serving_time), dict(self.exploration_loss)
        buckets = {}
        for b in sorted(decided):
            buckets[b] = {"k": current[b].k if b in current else None, "batch_size": self.decided_at.get(b),
                          "speed_index": round(self.speed(b), 4),
                          "k_beside_prompt": beside[b].k if b in beside else None,
                          "exploration_share": explored.get(b, 0) / decided[b],
                          "exploration_loss_share": lost.get(b, 0.0) / served[b] if served.get(b) else 0.0,
                          "predicted_goodput": {s.label: round(v, 1) for s, v in dict(predicted.get(b, {})).items()}}
        gain = self.acceptance.tree_gain
        return {"policy": self.policy, "acceptance_per_position": [round(r, 4) for r in self.position_rates()],
                "tree_gain": {"mean": round(gain.total / len(gain), 4) if len(gain) else None, "samples": len(gain)},
                "prompt_extra": {f"topk-{k}": {"ms": round(a * 1e3, 3), "us_per_verify_token": round(m * 1e6, 3)}
                                 for k, (a, m) in self.prompt_lines.items()},
                "exploration_budget": self.exploration_budget, "calibration": self.calibration, "buckets": buckets}

    def _maybe_probe(self, b: int, best: Shape, batch_size: int) -> Shape:
        """Now and then, instead of the best shape, another: in turn the runner-up (so that a near-tie
        judged on noisy times is settled; a tree rated by what its gain could still be, `gain_hope`, so a
        few unlucky verifies do not rule it out) and the one whose time estimate is oldest (so that no estimate
        stays stale: one taken in an odd step would otherwise hold for good); acceptance is sampled
        while plain decoding runs. A probe waits at least `probe_every` steps and until the
        bucket's exploration credit (see `record_step`) covers its price: `min_samples` steps' loss were
        the shape at its `hoped_seconds` (a shape priced dear by a slow spell would otherwise wait long for
        the probe that shows it fast again), and for a probe out of plain decoding the catch-up."""
        if self.steps_taken < self.next_probe.setdefault(b, self.steps_taken + self.probe_every):
            return best
        others = [s for s in self.shapes if s != best] or [best]
        if self.probes.get(b, 0) % 2 and all(self._priced(b, s) for s in others):  # the runner-up: a near-tie settles
            shape = max(others, key=lambda s: self.goodput(b, s, batch_size, hope=True))
        else:  # the oldest estimate: none stays stale
            shape = min(others, key=lambda s: self.last_sample.get((b, s), -1))
        per_step = self._loss(b, shape, best, batch_size, self.hoped_seconds(b, shape, batch_size)) \
            if self._priced(b, shape) else self.seconds(b, best, batch_size)  # unpriced: dear
        price = self.min_samples * per_step + (self.catch_up_price(b, batch_size) if best == PLAIN else 0.0)
        credit = self.credit[b] = min(self.credit.get(b, 0.0), 2 * price)  # no bursts after a long calm
        if credit < price:  # look again when the credit should cover it (or sooner, as the price may change)
            earned = self.exploration_budget * self.seconds(b, best, batch_size)  # per step
            wait = (price - credit) / max(earned, 1e-12)
            self.next_probe[b] = self.steps_taken + max(1, min(self.probe_every, int(wait)))
            return best
        self.next_probe[b] = self.steps_taken + self.probe_every
        self.probes[b] = self.probes.get(b, 0) + 1
        self.stale.add((b, shape))
        self.probing[b] = [shape] * (self.min_samples - 1)
        return shape

    def catch_up_price(self, b: int, batch_size: int) -> float:
        """What a draft's first step after the plain steps since the last draft step would cost on top of
        an ordinary one, for the pairs it catches up on (batch size x plain steps): on a robust line through
        the latest catch-ups (any bucket's) in their pairs, read no further than twice the most pairs any
        of them caught up on; none before the first, which that one probe teaches. Early gaps are short,
        and a step's noise (+-10%) over their few pairs reads as a steep per-pair cost: carried out to a
        long gap's pairs it priced every later probe out of the budget, and plain held for good (10-14%
        lost in the tests' random tables). So each probe may look at most twice as far as the last."""
        if not self.catch_ups:
            return 0.0
        intercept, slope = robust_line(list(self.catch_ups))
        pairs = min(batch_size * self.plain_steps, 2 * max(p for p, _ in self.catch_ups))
        return max(0.0, intercept + slope * pairs)

    def _loss(self, b: int, shape: Shape, best: Shape, batch_size: int, seconds: float) -> float:
        """Serving time a step of `shape` taking `seconds` loses against the best shape's goodput."""
        return max(0.0, seconds - batch_size * self.expected_tokens(shape) / self.goodput(b, best, batch_size))

    def expected_tokens(self, shape: Shape) -> float:
        """Tokens one request gains from a step of this shape (`Acceptance.expected_tokens`)."""
        return self.acceptance.expected_tokens(shape)

    def position_rates(self) -> list[float]:
        return self.acceptance.position_rates()

    def goodput(self, b: int, shape: Shape, batch_size: int, hope: bool = False) -> float:
        """Tokens/s predicted for a step of this shape; hope: what a probe could find, a tree's gain at its
        upper bound and the step at its `hoped_seconds`."""
        tokens = self.acceptance.expected_tokens(shape, hope)
        seconds = self.hoped_seconds(b, shape, batch_size) if hope else self.seconds(b, shape, batch_size)
        return batch_size * tokens / max(seconds, 1e-9)

    def hoped_seconds(self, b: int, shape: Shape, batch_size: int) -> float:
        """A step of this shape at the least of its estimate now and its start-up time (the machine back at
        start-up's speed, the shape at what it measured). Plain's estimate is its start-up time at the speed
        index its own steps set, and a draft's its live times: a spell of slow plain steps (beside
        prompts, after each draft run) prices plain dear, and a price read off that estimate alone kept its
        probes out of the budget for hundreds of steps (in the 8B sweep, chain-1 held at -11% through a
        level). The budget charges what a probe does lose (`_account`), so hoping costs no more than it."""
        now = self.seconds(b, shape, batch_size)
        table = self.start_up.get((b, shape))
        if table is None:
            return now
        base = table.line(batch_size) if shape == PLAIN else table.median(batch_size, self.start_up.get((b, PLAIN)))
        return min(now, base + self.token_seconds * batch_size * self.expected_tokens(shape))

    def seconds(self, b: int, shape: Shape, batch_size: int) -> float:
        """A step of this shape at this batch size, at the machine's current speed."""
        return self.speed(b) * self._cost(b, shape, batch_size)

    def _cost(self, b: int, shape: Shape, batch_size: int, tokens: Optional[float] = None) -> float:
        """A step's time at the speed index 1 when it emits `tokens` (default: the shape's expected)."""
        tokens = batch_size * self.expected_tokens(shape) if tokens is None else tokens
        return self._base(b, shape, batch_size) + self.token_seconds * tokens

    def speed(self, b: int) -> float:
        """Bucket b's speed index: the median speed plain's latest steps implied (1 before any; the window
        begins with `speed_window // 2` ones, so a drift moves it after a majority of steps show it and a
        single odd step never does)."""
        implied = self.implied_speed.get(b)
        return implied.median if implied else 1.0

    def _base(self, b: int, shape: Shape, batch_size: int) -> float:
        """A step's time at the speed index 1 less its emitted tokens' (see `StepTimes` for how batch sizes
        are read). A draft shape
        not timed at all in bucket b is guessed from plain's time here and its cost ratio to plain in the
        nearest smaller bucket that measured both (`_ratio`; hopeful, as a verify's relative cost grows
        with the batch); the caller checks `_priced` first."""
        plain = self.step_time.get((b, PLAIN))
        if shape == PLAIN:
            return plain.line(batch_size)
        ratio = self._ratio(b, shape) if not self._samples(b, shape) else None
        if ratio is not None:
            return plain.line(batch_size) * ratio
        return self.step_time[(b, shape)].median(batch_size, plain)

    def _ratio(self, b: int, shape: Shape) -> Optional[float]:
        """A draft shape's cost over plain's in the nearest smaller bucket that measured both, or None."""
        if self._samples(b, PLAIN) < self.min_samples:
            return None
        smaller = [c for (c, s), t in self.step_time.items()
                   if s == shape and c < b and len(t) >= self.min_samples and self._samples(c, PLAIN)]
        if not smaller:
            return None
        c = max(smaller)
        return self._base(c, shape, c) / self._base(c, PLAIN, c)

    def _priced(self, b: int, shape: Shape) -> bool:
        """Is there a time for this shape in bucket b: measured, or guessed from a smaller bucket?"""
        n = self._samples(b, shape)  # a measurement begun (a probe cut short by a catch-up) is completed
        return n >= self.min_samples or (n == 0 and shape != PLAIN and self._ratio(b, shape) is not None)

    def _samples(self, b: int, shape: Shape) -> int:
        return len(self.step_time.get((b, shape), ()))

    def forget_acceptance(self) -> None:
        """Learn acceptance afresh (the drafter or the workload changed); step times stay."""
        self.acceptance.forget()
        self.changes += 1

    def pin_acceptance(self, rates: list[float]) -> None:
        """Fix the per-position acceptance (`Acceptance.pin`)."""
        self.acceptance.pin(rates)
        self.changes += 1

    # ---- observations -------------------------------------------------------------------------
    def record_step(self, batch_size: int, shape: Shape, seconds: float, typical: bool = True,
                    caught_up: int = 0, tokens: Optional[float] = None) -> None:
        """A decode step's wall time. The machine's speed drifts (load, other tenants) and the shapes are
        measured at different times, so times are kept at a per-bucket speed index, which plain's steps
        track once its times are known: plain anchors the drafts, whose steps (chosen or probed) refine
        their own estimates at the current index. A machine that slows while a draft runs makes the draft
        look dearer until plain runs again (chosen or probed) and moves the index, and its times with it
        (`_reanchor`). Every step earns the bucket `exploration_budget` of its time as credit; a step of
        another shape than the chosen one is charged what it lost against it. A step that is
        not `typical` of its shape (a draft catching up on `caught_up` pairs after plain steps) is charged
        but not timed; what it cost over an ordinary step prices later probes' catch-ups. `tokens`: what
        the step emitted (default: the shape's expected tokens), whose host time is kept apart."""
        b = bucket(batch_size)
        self._account(b, shape, batch_size, seconds)
        self.plain_steps = self.plain_steps + 1 if shape == PLAIN else 0
        if not typical:
            if caught_up and self._priced(b, shape):
                self.catch_ups.append((caught_up, seconds - self.seconds(b, shape, batch_size)))
            return
        if (b, shape) in self.stale:  # the first step of a probe: what it measures replaces the old estimate
            self.stale.discard((b, shape))
            self.step_time.pop((b, shape), None)
        self.records += 1
        self.last_sample[(b, shape)] = self.records
        if shape == PLAIN and self._samples(b, shape) >= self.window:
            # plain's times are known: its steps move the speed index (all shapes alike), not them
            implied = self.implied_speed.get(b)
            if implied is None:  # begun with a minority at the index its times were kept at: one odd step
                implied = self.implied_speed[b] = Recent(self.speed_window)  # (a wait on a prefill) moves nothing
                for _ in range(self.speed_window // 2):
                    implied.add(1.0)
            before = implied.median
            implied.add(seconds / self._cost(b, shape, batch_size, tokens))
            since = self.plain_since[b] = self.plain_since.get(b, 0) + 1
            if since <= self.min_samples and self.unanchored.get(b):  # as long as a probe of plain
                self._reanchor(b, before / implied.median)
            return
        if shape == PLAIN:
            self.plain_since[b] = self.plain_since.get(b, 0) + 1
        else:
            unanchored = self.unanchored.setdefault(b, {})
            if self.plain_since.get(b, 0):  # plain ran since the last draft step: earlier draft times are anchored
                unanchored.clear()
            unanchored[shape] = min(unanchored.get(shape, 0) + 1, self.window)
            self.plain_since[b] = 0
        emitted = batch_size * self.expected_tokens(shape) if tokens is None else tokens
        self.step_time.setdefault((b, shape), StepTimes(self.window)).add(
            batch_size, seconds / self.speed(b) - self.token_seconds * emitted)
        self.changes += 1

    def _reanchor(self, b: int, factor: float) -> None:
        """Plain's latest steps moved bucket b's speed index by 1 / factor: the draft times taken since the
        plain steps before them were kept at the old index, which the machine had left while they ran (it
        is only read from plain's steps), so over the first `min_samples` plain steps after them (a probe
        of plain) they move with it: a draft is not charged a slowdown that plain then shows too."""
        if factor == 1.0:
            return
        for shape, n in self.unanchored.get(b, {}).items():
            times = self.step_time.get((b, shape))
            if times is not None:
                times.rescale_last(n, factor)
                self.changes += 1

    def _account(self, b: int, shape: Shape, batch_size: int, seconds: float) -> None:
        """The exploration budget's books: credit earned, and what a step away from the choice lost."""
        self.serving_time[b] = self.serving_time.get(b, 0.0) + seconds
        self.credit[b] = self.credit.get(b, 0.0) + self.exploration_budget * seconds
        best = self.current.get(b)
        if best is None or shape == best or not self._priced(b, best) or not self._priced(b, shape):
            return
        loss = self._loss(b, shape, best, batch_size, seconds)
        self.credit[b] -= loss
        self.exploration_loss[b] = self.exploration_loss.get(b, 0.0) + loss

    def seed_costs(self, times: dict[tuple[int, Shape], list[float]], summary: Optional[dict] = None,
                   tokens: Optional[dict[tuple[int, Shape], list[int]]] = None, token_seconds: float = 0.0,
                   prompt_extra: Optional[dict[tuple[int, Shape], list[float]]] = None,
                   prompt_token_seconds: float = 0.0) -> None:
        """Step times measured before serving (speculative/calibration.py): per (batch size, shape), the
        seconds of a few steps and the tokens each emitted, and the host seconds per emitted token. They
        stand as each shape's estimate in the batch size's bucket until live steps (of the chosen shape)
        or probes (of the others) replace them. `prompt_extra`: per (batch size, draft shape), the seconds
        its step with a prompt cost over a plain one (read through a line per draft family, `prompt_extra`,
        up to twice the largest batch size measured; kept, not refreshed: steps with a prompt are not timed
        live); `prompt_token_seconds`: what a prompt token cost to compute. `summary` is shown by `explain`."""
        self.calibration = summary
        self.token_seconds = token_seconds
        self.prompt_token_seconds = prompt_token_seconds
        self.changes += 1
        families: dict[int, list[tuple[float, float]]] = {}  # per topk: (verify tokens added, seconds)
        for (n, shape), seconds in (prompt_extra or {}).items():
            families.setdefault(shape.topk, []).extend((n * (shape.num_nodes - 1), t) for t in seconds)
            self.prompt_batch = max(self.prompt_batch, 2 * n)
        self.prompt_lines.update({topk: robust_line(points) for topk, points in families.items()})
        for (n, shape), seconds in times.items():
            emitted = (tokens or {}).get((n, shape)) or [n] * len(seconds)
            # a bucket's own batch size, and the lower edge of the next one (64 for 65..128): plain's line
            # there then has a slope, and a batch of 70 is not priced as one of 128
            for b in {bucket(n), bucket(n + 1)}:
                window = self.step_time.setdefault((b, shape), StepTimes(self.window))
                for t, e in zip(seconds, emitted):
                    window.add(n, t - token_seconds * e)
        self.start_up = {key: times.copy() for key, times in self.step_time.items()}

    def record_verify(self, shape: Shape, num_accepted: int, spine: Optional[tuple[int, int]] = None) -> None:
        """One request's verify accepted num_accepted drafts; of a tree's spine, spine[0] of spine[1]."""
        self.changes += 1
        self.acceptance.record(shape, num_accepted, spine)
