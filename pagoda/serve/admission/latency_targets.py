"""Latency-aware admission: refuse new requests while the admitted ones miss their targets.

A bounded queue (admission.py) keeps the server up under overload, but every admitted stream
still slows down as the batch grows. With `--target-ttft-ms` / `--target-itl-ms` the server
watches the latencies its admitted requests actually get over a short sliding window and,
while the window's p90 exceeds a target, answers new requests with 503 + Retry-After instead
of adding them to a batch that would break the targets for everyone. Feedback, not a model:
it needs no per-hardware calibration, and because refusals add no new observations the
window drains and admission reopens by itself within `window_s`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_WINDOW_S = 5.0
MIN_SAMPLES = 4  # fewer observations than this in the window never refuse


@dataclass(frozen=True)
class LatencyTargets:
    """Per-request targets in seconds; None = no target for that latency."""

    ttft_s: float | None = None
    itl_s: float | None = None
    window_s: float = DEFAULT_WINDOW_S

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"target {name} must be a positive number of seconds, got {value}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None


class LatencyWindow:
    """Weighted observations of the last `window_s` seconds, with a percentile."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float, int]] = deque()  # (time, value, weight)
        self._weight = 0

    def observe(self, value: float, weight: int = 1) -> None:
        if weight > 0:
            self._samples.append((self._clock(), value, weight))
            self._weight += weight

    def count(self) -> int:
        self._expire()
        return self._weight

    def percentile(self, q: float) -> float | None:
        self._expire()
        if not self._samples:
            return None
        ordered = sorted((value, weight) for _, value, weight in self._samples)
        rank = q * self._weight
        seen = 0
        for value, weight in ordered:
            seen += weight
            if seen >= rank:
                return value
        return ordered[-1][0]

    def oldest_age(self) -> float:
        self._expire()
        return self._clock() - self._samples[0][0] if self._samples else 0.0

    def _expire(self) -> None:
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._weight -= self._samples.popleft()[2]


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after_s: float


class LatencyGuard:
    """Decides, per new request, whether admitting it would join a batch missing its targets."""

    def __init__(self, targets: LatencyTargets, clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = targets
        self.ttft = LatencyWindow(targets.window_s, clock)
        self.itl = LatencyWindow(targets.window_s, clock)

    def observe_ttft(self, seconds: float) -> None:
        if self.targets.ttft_s is not None:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds_per_token: float, num_tokens: int = 1) -> None:
        if self.targets.itl_s is not None:
            self.itl.observe(seconds_per_token, num_tokens)

    def check(self) -> Refusal | None:
        """None to admit, or why not and when to retry."""
        for name, window, target in (
            ("time to first token", self.ttft, self.targets.ttft_s),
            ("inter-token latency", self.itl, self.targets.itl_s),
        ):
            if target is None or window.count() < MIN_SAMPLES:
                continue
            p90 = window.percentile(0.9)
            if p90 is not None and p90 > target:
                retry = max(1.0, math.ceil(self.targets.window_s - window.oldest_age()))
                return Refusal(
                    f"Server at its latency target: recent p90 {name} {p90 * 1000:.0f} ms exceeds "
                    f"the {target * 1000:.0f} ms target. Retry later.",
                    retry,
                )
        return None
