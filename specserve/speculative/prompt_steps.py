"""Steps that also compute prompt tokens: speculate beside the prompt, or decode plain.

A step that computes a prompt chunk of P tokens beside B decoding requests costs the chunk on top of a
decode step, and, when its rows speculate, a penalty that the decode-only times do not show: such a step
runs synchronously, outside the overlapped loop, and its verify tokens join a step the chunk has made
compute-bound. Where requests arrive every few steps (C = 5-10 on the H200) decoding plain beside each
prompt gives up a fifth of the steps' speculation; where most steps carry a prompt (C >= 70) speculating
beside them costs more than it gains. So the penalty is measured, per batch bucket and shape: a step beside
a prompt is kept as its time over the decode-only time of its shape and batch size (`Controller.seconds`),
with its P; plain's are read as a robust line in P (the chunk's own cost, per bucket: a chunk beside 250
decoding rows costs more than beside 5, as a pooled line measured on the H200), a draft's penalty is the
median of its times over that line.

The choice is between plain and the bucket's decode-only choice (`Controller.current`), by opportunity
cost: the draft's extra tokens B (E - 1) are worth B (E - 1) / G seconds of decoding at its goodput G; its
extra seconds are the decode-only difference, plus the penalty, less the catch-up that a plain step would
leave the next draft step (`Controller.catch_up_price`). Plain runs until its line is known; the draft is
then measured for `min_samples` steps (the additive model says it wins); once it has lost, it is probed
again at most every `probe_every` prompt steps and only while the bucket's exploration credit covers
`min_samples` steps of its measured loss (credit earned as the decode-only steps earn theirs, by their own
time: `exploration_budget` of it).
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Optional

from .estimates import StepTimes
from .shapes import PLAIN, Shape, bucket

if TYPE_CHECKING:
    from .controller import Controller


class PromptSteps:
    """The adaptive policy's choice for steps that compute prompt tokens (see the module docstring)."""

    def __init__(self, controller: "Controller"):
        self.c = controller
        # (bucket, shape): (prompt tokens, seconds over the shape's decode-only step) of the latest steps
        self.times: dict[tuple[int, Shape], StepTimes] = {}
        self.choice: dict[int, Shape] = {}  # per bucket: the latest choice that was not a probe
        self.probing: dict[int, int] = {}  # per bucket: probe steps still to take
        self.next_probe: dict[int, int] = {}  # per bucket: the prompt step from which it may probe again
        self.stale: set[tuple[int, Shape]] = set()  # probed, and the old times not yet replaced
        self.credit: dict[int, float] = {}  # per bucket: seconds its prompt steps may still lose exploring
        self.probe_loss: dict[int, float] = {}  # per bucket: what each step of its latest probe was priced at
        self.steps = 0  # prompt steps decided

    def choose(self, b: int, batch_size: int) -> Shape:
        c = self.c
        self.steps += 1
        draft = c.current.get(b, PLAIN)
        if draft == PLAIN or not (c._priced(b, draft) and c._priced(b, PLAIN)) or not self._known(b, PLAIN):
            return self._chosen(b, PLAIN)
        if self.probing.get(b):
            self.probing[b] -= 1
            return draft
        if not self._known(b, draft):  # not measured yet: believed to win
            return self._chosen(b, draft)
        loss = self.loss(b, draft, batch_size)
        if loss < 0:
            return self._chosen(b, draft)
        self._chosen(b, PLAIN)
        price = c.min_samples * loss
        credit = self.credit[b] = min(self.credit.get(b, 0.0), 2 * price)  # no bursts after a long calm
        if self.steps >= self.next_probe.setdefault(b, self.steps + c.probe_every) and credit >= price:
            self.next_probe[b] = self.steps + c.probe_every
            self.stale.add((b, draft))
            self.probe_loss[b] = loss
            self.probing[b] = c.min_samples - 1
            return draft
        return PLAIN

    def _chosen(self, b: int, shape: Shape) -> Shape:
        self.choice[b] = shape
        return shape

    def _known(self, b: int, shape: Shape) -> bool:
        return len(self.times.get((b, shape), ())) >= self.c.min_samples

    def penalty(self, b: int, shape: Shape) -> float:
        """Seconds a step of this draft shape beside a prompt costs over its decode-only step and the prompt's
        own cost (plain's line at the same prompt tokens)."""
        plain = self.times[(b, PLAIN)]
        return statistics.median(t - plain.line(p) for p, t in self.times[(b, shape)].samples)

    def loss(self, b: int, shape: Shape, batch_size: int) -> float:
        """Serving seconds a step beside a prompt loses by speculating with this shape instead of decoding
        plain (negative: it gains), at the margin the controller's hysteresis asks."""
        c = self.c
        gained = batch_size * (c.expected_tokens(shape) - 1) / c.goodput(b, shape, batch_size)
        extra = c.seconds(b, shape, batch_size) - c.seconds(b, PLAIN, batch_size) + self.penalty(b, shape)
        extra -= c.catch_up_price(b, batch_size, steps=1)
        return extra - gained * (1 - c.hysteresis)

    def record(self, batch_size: int, shape: Shape, seconds: float, prompt_tokens: int, typical: bool) -> None:
        """A step beside prompt_tokens prompt tokens: charged to the exploration budget's books and, when
        `typical` and the shape's decode-only time is known, kept as its time over that."""
        c, b = self.c, bucket(batch_size)
        c.serving_time[b] = c.serving_time.get(b, 0.0) + seconds
        self.credit[b] = self.credit.get(b, 0.0) + c.exploration_budget * seconds
        if shape != PLAIN and self.choice.get(b) == PLAIN:  # a probe: charged what it was priced at
            loss = self.probe_loss.get(b, 0.0)
            self.credit[b] -= loss
            c.exploration_loss[b] = c.exploration_loss.get(b, 0.0) + loss
        if not typical or not (c._priced(b, shape) and c._priced(b, PLAIN)):
            return
        if (b, shape) in self.stale:  # the first step of a probe: what it measures replaces the old times
            self.stale.discard((b, shape))
            self.times.pop((b, shape), None)
        self.times.setdefault((b, shape), StepTimes(c.window)).add(
            prompt_tokens, seconds - c.seconds(b, shape, batch_size))
        c.changes += 1

    def explain(self, b: int) -> Optional[dict]:
        """Bucket b's choice beside prompts and the penalty measured for it (None before any)."""
        shape = self.choice.get(b)
        if shape is None:
            return None
        draft = self.c.current.get(b, PLAIN)
        known = draft != PLAIN and self._known(b, draft) and self._known(b, PLAIN)
        return {"k": shape.k, "penalty_ms": round(1e3 * self.penalty(b, draft), 3) if known else None}
