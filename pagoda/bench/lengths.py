"""Token-length distributions for workloads: fixed, uniform, or a lognormal fitted to p50/p95."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# z-score of the 95th percentile of a standard normal.
Z95 = 1.6448536269514722

LENGTH_SPEC_HELP = "N (fixed), uniform:LO:HI, or lognormal:P50:P95 (a lognormal with those percentiles)"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths. `kind` is fixed, uniform or lognormal."""

    kind: str
    a: float  # fixed: the value; uniform: low; lognormal: p50
    b: float = 0.0  # uniform: high; lognormal: p95

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        mu = math.log(self.a)
        sigma = (math.log(self.b) - mu) / Z95
        return max(1, round(math.exp(rng.gauss(mu, sigma))))

    def scaled(self, factor: float) -> LengthDist:
        if factor == 1.0:
            return self

        def scale(x: float) -> float:
            return max(1.0, round(x * factor))

        return LengthDist(self.kind, scale(self.a), scale(self.b) if self.kind != "fixed" else 0.0)

    @property
    def median(self) -> float:
        return self.a if self.kind != "uniform" else (self.a + self.b) / 2

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{int(self.a)}:{int(self.b)}"


def fixed(n: int) -> LengthDist:
    return LengthDist("fixed", n)


def uniform(lo: int, hi: int) -> LengthDist:
    return LengthDist("uniform", lo, hi)


def lognormal(p50: int, p95: int) -> LengthDist:
    return LengthDist("lognormal", p50, p95)


def parse_length(spec: str) -> LengthDist:
    """'128' | 'uniform:64:256' | 'lognormal:200:1000' -> LengthDist."""
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1:
            dist = fixed(int(parts[0]))
        elif parts[0] in ("fixed",) and len(parts) == 2:
            dist = fixed(int(parts[1]))
        elif parts[0] == "uniform" and len(parts) == 3:
            dist = uniform(int(parts[1]), int(parts[2]))
        elif parts[0] in ("lognormal", "p50p95") and len(parts) == 3:
            dist = lognormal(int(parts[1]), int(parts[2]))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"bad length {spec!r}; expected {LENGTH_SPEC_HELP}") from None
    if dist.a < (0 if dist.kind == "fixed" else 1) or (dist.kind != "fixed" and dist.b < dist.a):
        raise ValueError(f"bad length {spec!r}: values must be positive and the second >= the first")
    return dist
