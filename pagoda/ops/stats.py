"""Small statistics the audit uses: AUC and its bootstrap interval (percentiles: pagoda.stats)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pagoda.stats import percentile


def auc(positives: Sequence[float], negatives: Sequence[float]) -> float | None:
    """P(score of a positive > score of a negative), ties counting half (Mann-Whitney U)."""
    if not positives or not negatives:
        return None
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    return wins / (len(positives) * len(negatives))


def bootstrap_auc_interval(
    positives: Sequence[float],
    negatives: Sequence[float],
    *,
    num_resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile bootstrap confidence interval of the AUC, resampling each class."""
    if not positives or not negatives:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(num_resamples):
        pos = [rng.choice(positives) for _ in positives]
        neg = [rng.choice(negatives) for _ in negatives]
        values.append(auc(pos, neg) or 0.5)
    tail = (1 - level) / 2 * 100
    return percentile(values, tail) or 0.0, percentile(values, 100 - tail) or 0.0
