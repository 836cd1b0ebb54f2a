"""Value objects shared by every benchmark target: what to send, and what happened."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BenchRequest:
    """One request of a workload. `prompt` is the completions text (or its token ids, which
    OpenAI-compatible servers accept too); `messages` the same for chat."""

    index: int
    class_name: str
    prompt: str | list[int]
    messages: list[dict[str, str]]
    prompt_len: int  # exact tokens of `prompt` with the tokenizer's special tokens
    output_len: int  # max_tokens sent (exactly this many with ignore_eos)
    session: int | None = None  # agent sessions: turns of one session run in order
    turn: int = 0

    def prompt_ids(self, encode: Callable[[str], list[int]]) -> list[int]:
        """The prompt as token ids: the text encoded, or the ids it already is."""
        return self.prompt if isinstance(self.prompt, list) else encode(self.prompt)

    depends_on: int | None = None  # index of the request that must finish before this one is sent


@dataclass
class RequestRecord:
    """Timings of one request, in seconds. `start` is relative to the start of the run."""

    index: int
    class_name: str
    prompt_len: int
    output_len: int
    start: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    status: int = 0  # HTTP status; 200 ok; 0 for a connection failure or timeout
    error: str | None = None
    cached_tokens: int | None = None  # as reported by the target, when it reports them
    reported_prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def finish(self) -> float | None:
        return None if self.e2e is None else self.start + self.e2e


@dataclass
class RunResult:
    """Every record of one run, its length, and the target's Prometheus samples before and after."""

    records: list[RequestRecord]
    duration: float  # start of the run to the last completion, seconds
    started_at: float  # wall clock (time.time()) of the start
    metrics_before: dict[tuple[str, str | None], float] | None = None
    metrics_after: dict[tuple[str, str | None], float] | None = None


def records_from_json(rows: list[dict[str, Any]]) -> list[RequestRecord]:
    """Per-request records as written to results.json, back into RequestRecords (e.g. to re-plot)."""
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    return [RequestRecord(**{k: v for k, v in row.items() if k in names}) for row in rows]
