"""What drafts are accepted at, learned from verifies, for the adaptive controller: per draft position of a
chain, the rate it is accepted given the ones before it were; per tree, the tokens a verify gained. Pooled
over batch sizes (acceptance does not depend on the batch), over the latest `window` verifies."""
from __future__ import annotations

from .estimates import Pinned, Recent
from .shapes import Shape


class Acceptance:
    def __init__(self, depth: int, window: int = 512, prior_samples: int = 16):
        """depth: the most draft steps of any shape; prior_samples: the pseudo-samples that pull a position's
        (or a tree's) few samples toward its prior."""
        self.depth, self.window, self.prior_samples = depth, window, prior_samples
        self.forget()

    def forget(self) -> None:
        """Learn afresh (the drafter or the workload changed)."""
        self.positions = [Recent(self.window) for _ in range(self.depth)]
        self.tree_tokens = Recent(self.window)

    def pin(self, rates: list[float]) -> None:
        """Fix the per-position rates (the last repeats for deeper positions) and stop learning them: for
        benchmarks of random weights, which accept nothing, and for tests of the step-time side alone."""
        self.positions = [Pinned(rates[min(i, len(rates) - 1)]) for i in range(self.depth)]

    def record(self, shape: Shape, num_accepted: int) -> None:
        """One request's verify of a step of this shape accepted `num_accepted` drafts."""
        if shape.topk > 1:
            self.tree_tokens.add(1.0 + num_accepted)
            return
        for i in range(min(num_accepted + 1, shape.steps)):  # positions reached: accepted ones + the first rejected
            self.positions[i].add(1.0 if i < num_accepted else 0.0)

    def position_rates(self) -> list[float]:
        """Per draft position, the rate it is accepted given the ones before it were. A position's few
        samples are pulled toward the position before it by `prior_samples` pseudo-samples: deep
        positions are only sampled while a long draft runs, so a handful of early (or warm-up) verifies
        would otherwise hold a long draft off for good (acceptance varies little between positions)."""
        rates, prior = [], 0.5
        for window in self.positions:
            n = len(window)
            rate = (window.mean * n + prior * self.prior_samples) / (n + self.prior_samples) if n else prior
            rates.append(rate)
            prior = rate
        return rates

    def expected_tokens(self, shape: Shape) -> float:
        """Tokens one request gains from a step of this shape: accepted drafts plus the bonus. A tree's few
        samples are pulled toward the chain of its depth by `prior_samples` pseudo-samples: its top-ranked
        spine is that chain, so it accepts at least as much (without the prior an unsampled tree counted one
        token a step and was never chosen once acceptance was forgotten)."""
        if shape.steps == 0:
            return 1.0
        if shape.topk > 1:
            n, prior = len(self.tree_tokens), self.expected_tokens(Shape(shape.steps, 1, shape.steps + 1))
            return (self.tree_tokens.total + prior * self.prior_samples) / (n + self.prior_samples)
        total, reach = 1.0, 1.0
        for rate in self.position_rates()[:shape.steps]:
            reach *= rate
            total += reach
        return total
