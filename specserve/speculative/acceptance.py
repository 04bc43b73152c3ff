"""What drafts are accepted at, learned from verifies, for the adaptive controller: per draft position of a
chain, the rate it is accepted given the ones before it were; per tree, the drafts it accepts beyond its
spine. Pooled over batch sizes (acceptance does not depend on the batch), over the latest `window` verifies.

A tree's spine (from the root, each node's first, top-ranked child) is the chain of the same drafter: a tree
verify tells both what the tree accepted and what that chain would have (the accepted path's leading spine
nodes). So each tree verify is a chain sample too, and a tree is rated as the chain of its depth plus its
mean gain over its own spine: a paired difference, which a few verifies measure (a tree's total, compared
with separately sampled chains, took dozens at one request a step).
"""
from __future__ import annotations

from typing import Optional

from .estimates import Pinned, Recent
from .shapes import Shape


class Acceptance:
    def __init__(self, depth: int, window: int = 512, prior_samples: int = 16, gain_prior_samples: int = 4):
        """depth: the most draft steps of any shape; prior_samples: the pseudo-samples that pull a position's
        few samples toward its prior; gain_prior_samples: those that pull a tree's few gains toward none."""
        self.depth, self.window, self.prior_samples = depth, window, prior_samples
        self.gain_prior_samples = gain_prior_samples
        self.forget()

    def forget(self) -> None:
        """Learn afresh (the drafter or the workload changed)."""
        self.positions = [Recent(self.window) for _ in range(self.depth)]
        self.tree_gain = Recent(self.window)

    def pin(self, rates: list[float]) -> None:
        """Fix the per-position rates (the last repeats for deeper positions) and stop learning them: for
        benchmarks of random weights, which accept nothing, and for tests of the step-time side alone."""
        self.positions = [Pinned(rates[min(i, len(rates) - 1)]) for i in range(self.depth)]

    def record(self, shape: Shape, num_accepted: int, spine: Optional[tuple[int, int]] = None) -> None:
        """One request's verify of a step of this shape accepted `num_accepted` drafts. For a tree, spine:
        (drafts of its spine accepted, the spine's length in the tree); without it a tree verify is not
        learned from."""
        if shape.topk > 1:
            if spine is not None:
                accepted, length = spine
                self._record_chain(accepted, length)
                self.tree_gain.add(float(num_accepted - accepted))
            return
        self._record_chain(num_accepted, shape.steps)

    def gain_hope(self, shape: Shape) -> float:
        """What a tree's mean gain over its spine could still be: its gains with `gain_prior_samples`
        pseudo-samples at the tree's depth (no tree gains more), where the estimate has them at none; the
        truth lies between the two, which meet as verifies come. So a tree whose first few verifies gained
        nothing is still tried where a fair gain would make it win."""
        return (self.tree_gain.total + self.gain_prior_samples * shape.steps) / (
            len(self.tree_gain) + self.gain_prior_samples)

    def _record_chain(self, num_accepted: int, length: int) -> None:
        """A chain of `length` drafts accepted its first num_accepted."""
        for i in range(min(num_accepted + 1, length)):  # positions reached: accepted ones + the first rejected
            self.positions[i].add(1.0 if i < num_accepted else 0.0)

    def young(self) -> bool:
        """Fewer verifies than `prior_samples` have reached the first draft position: acceptance is still
        mostly the prior's."""
        return len(self.positions[0]) < self.prior_samples

    def position_rates(self, first_prior: float = 0.5) -> list[float]:
        """Per draft position, the rate it is accepted given the ones before it were. A position's few
        samples are pulled toward the position before it by `prior_samples` pseudo-samples (the first
        toward first_prior): deep positions are only sampled while a long draft runs, so a handful of
        early (or warm-up) verifies would otherwise hold a long draft off for good (acceptance varies
        little between positions)."""
        rates, prior = [], first_prior
        for window in self.positions:
            n = len(window)
            rate = (window.mean * n + prior * self.prior_samples) / (n + self.prior_samples) if n else prior
            rates.append(rate)
            prior = rate
        return rates

    def expected_tokens(self, shape: Shape, hope: bool = False) -> float:
        """Tokens one request gains from a step of this shape: accepted drafts plus the bonus. A tree: the
        chain of its depth, plus its mean gain over its spine pulled toward none by `gain_prior_samples`
        (an unsampled tree is priced as that chain, never below it). hope: what it could still be, for
        choosing what to explore: the first position's prior at 1 instead of 0.5, a tree's gain at its
        upper bound (`gain_hope`)."""
        if shape.steps == 0:
            return 1.0
        if shape.topk > 1:
            chain = self.expected_tokens(Shape(shape.steps, 1, shape.steps + 1), hope)
            if hope:
                return chain + self.gain_hope(shape)
            return chain + self.tree_gain.total / (len(self.tree_gain) + self.gain_prior_samples)
        total, reach = 1.0, 1.0
        for rate in self.position_rates(1.0 if hope else 0.5)[:shape.steps]:
            reach *= rate
            total += reach
        return total
