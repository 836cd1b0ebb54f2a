"""Quantiles of measurements, one definition each: of samples (`percentile`, behind every p50
and p99 a report prints) and of a Prometheus histogram's buckets (`histogram_quantile`).

`percentile` interpolates linearly between the closest ranks: the sorted values sit at
positions 0..n-1, the q-th percentile is at position (n - 1) * q / 100, and a position between
two values takes the straight line between them. It is numpy's default (`method="linear"`) and
`statistics.quantiles(method="inclusive")`: p0 is the minimum, p100 the maximum, p50 the median.

`histogram_quantile` only knows bucket counts, so it interpolates inside the bucket the rank
falls in, as PromQL's histogram_quantile does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (q in 0..100) of `values` in any order, None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    return sorted_percentile(ordered, q)


def sorted_percentile(ordered: Sequence[float], q: float) -> float:
    """`percentile` of values already sorted, at least one."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 50)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (q in 0..1) from cumulative (upper bound, count) pairs, +Inf included:
    linear inside the bucket, the highest finite bound when it falls in +Inf; None when the
    histogram is empty or has no finite bound to give."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for index, (bound, count) in enumerate(ordered):
        if count >= rank:
            if math.isinf(bound):
                return lower if index > 0 else None
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
