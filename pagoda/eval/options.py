"""What `pagoda eval perplexity` is asked to do (the CLI fills it from flags). No heavy imports:
`pagoda eval --help` builds its parser from these defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PerplexityOptions:
    text: str  # a text file, or a directory of text files (recursive)
    window: int = 512  # tokens per window (capped by the model length)
    stride: int = 256  # tokens a window advances; each token gets at least window - stride of context
    max_tokens: int = 20000  # score at most this many tokens (0: all)
    baseline: bool = True  # also run the model at full precision and report the delta
    json: bool = False  # one JSON object instead of the text report
