"""Statistics for the fidelity study: bootstrap confidence intervals, paired differences,
rank correlation.  Plain Python plus torch's generator: no SciPy needed, and a fixed seed
makes every interval reproducible."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

RESAMPLES = 2000
SEED = 20240516  # the paper's arXiv month: any fixed number would do


@dataclass(frozen=True)
class Interval:
    """A mean and its 95 % percentile-bootstrap confidence interval."""

    mean: float
    low: float
    high: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap(values: list[float], resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """95 % percentile bootstrap interval of the mean of ``values``."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 1)
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return Interval(mean, means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1], n)


def paired(a: list[float], b: list[float], resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """Mean of ``a - b`` over the same prompts, with its bootstrap interval (prompts resampled
    together, so the prompt-to-prompt spread cancels)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    return bootstrap([x - y for x, y in zip(a, b, strict=True)], resamples, seed)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation ρ (NaN when either side is constant)."""
    if len(x) != len(y) or len(x) < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else math.nan
