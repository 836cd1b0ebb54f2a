"""SamplingParams: every per-request generation knob, validated once with a clear error."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagoda.errors import InvalidRequest

# Below this temperature a request is treated as greedy (argmax), as vLLM does.
GREEDY_TEMPERATURE_EPS = 1e-5

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to turn logits into tokens for one request.

    Field names and defaults follow vLLM's ``SamplingParams`` so clients can move over unchanged.
    Invalid values raise ``InvalidRequest`` (a ValueError) whose ``param`` names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token (0: only the sampled token)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise InvalidRequest(f"{param} {message}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature:
            fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    fail("logit_bias", f"has a negative token id {token_id}")
                if not -100.0 <= bias <= 100.0:
                    fail("logit_bias", f"value for token {token_id} must be in [-100, 100], got {bias}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "must contain only non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must contain only non-negative integers")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
