"""A histogram of token counts, kept by the engine and exported by the server's metrics.

The engine records how many tokens each step computed (vLLM's `iteration_tokens_total`); the
bounds live here, beside the engine, and the server's Prometheus histogram uses the same ones.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Powers of two and their 1.5x, up to 128k tokens.
TOKEN_BUCKETS: tuple[int, ...] = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
    12288,
    16384,
    32768,
    65536,
    131072,
)


@dataclass
class TokenHistogram:
    """Counts per bucket (the last one for values above every bound) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(TOKEN_BUCKETS) + 1))
    sum: int = 0

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect.bisect_left(TOKEN_BUCKETS, num_tokens)] += 1
        self.sum += num_tokens

    def copy(self) -> TokenHistogram:
        return TokenHistogram(list(self.counts), self.sum)
