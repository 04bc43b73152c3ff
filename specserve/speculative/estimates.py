"""The estimates the adaptive controller keeps: recent observations (`Recent`), a shape's step times in a
batch-size bucket read per batch size (`StepTimes`, through a robust line), a pinned acceptance rate."""
from __future__ import annotations

import statistics
from collections import deque
from typing import Optional


class Recent:
    """The latest `size` observations, read as their median or their mean."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=size)
        self.total = 0.0  # running sum: the mean is read every decision, from windows of hundreds

    def add(self, x: float) -> None:
        if len(self.values) == self.values.maxlen:
            self.total -= self.values[0]
        self.values.append(x)
        self.total += x

    def __len__(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def mean(self) -> float:
        return self.total / len(self.values)


def robust_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of a Theil-Sen line through (x, y) points: the median of the pairwise slopes, kept
    >= 0 (a step never gets cheaper with more requests or more draft tokens), then the median intercept;
    with a single x, the median y. Robust to a minority of outliers, as step times need."""
    slopes = [(yj - yi) / (xj - xi) for i, (xi, yi) in enumerate(points) for xj, yj in points[i + 1:] if xj != xi]
    slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    return statistics.median(y - slope * x for x, y in points), slope


class StepTimes:
    """One shape's latest step times in a bucket, with their batch sizes. A bucket spans batch sizes up
    to 2x apart (65..128) and a step's time may grow with them (on a CPU it nearly doubles), so plain's
    are read as a robust line in the batch size, and a draft's are each scaled by plain's line from
    their batch size to the one asked for."""

    def __init__(self, size: int):
        self.samples: deque[tuple[int, float]] = deque(maxlen=size)  # (batch size, seconds)
        self._fit: Optional[tuple[float, float]] = None
        self._medians: dict = {}  # (batch size, plain's version) -> median time (read every decision)
        self.version = 0  # samples added so far

    def add(self, batch_size: int, seconds: float) -> None:
        self.samples.append((batch_size, seconds))
        self._fit = None
        self._medians = {}
        self.version += 1

    def __len__(self) -> int:
        return len(self.samples)

    def copy(self) -> "StepTimes":
        other = StepTimes(self.samples.maxlen)
        for size, seconds in self.samples:
            other.add(size, seconds)
        return other

    def rescale_last(self, n: int, factor: float) -> None:
        """Multiply the latest n times by factor."""
        for i in range(max(0, len(self.samples) - n), len(self.samples)):
            size, seconds = self.samples[i]
            self.samples[i] = (size, seconds * factor)
        self._fit = None
        self._medians = {}
        self.version += 1

    def line(self, batch_size: int) -> float:
        if self._fit is None:
            self._fit = robust_line(list(self.samples))
        intercept, slope = self._fit
        return intercept + slope * batch_size

    def median(self, batch_size: int, plain: Optional["StepTimes"]) -> float:
        """The median of the times, each as if taken at this batch size (scaled by plain's line)."""
        key = (batch_size, plain.version if plain is not None else None)
        if key not in self._medians:
            times = [t for _, t in self.samples] if plain is None else \
                [t * plain.line(batch_size) / plain.line(n) for n, t in self.samples]
            self._medians[key] = statistics.median(times)
        return self._medians[key]


class Pinned:
    """A fixed acceptance rate in place of a live window (Controller.pin_acceptance)."""

    def __init__(self, rate: float):
        self.mean = rate

    def __len__(self) -> int:
        return 1 << 30  # as if measured without end: the prior has no weight

    def add(self, x: float) -> None:
        pass
