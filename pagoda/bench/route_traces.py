"""Request traces for the route simulator: generated (multi-tenant chat with shared system
prompts, RAG over per-tenant documents) or read from a file.

A trace file is JSON lines. Each line has `tenant`, `output_tokens`, a prompt as
`prompt_token_ids` or as text (`prompt`, tokenized with --tokenizer), and optionally `arrival_s`
(seconds from the start; lines without it arrive in file order at --rate). The server's own
request log (`pagoda serve --log-prompts`, logger pagoda.serve.requests) is such a file: each
of its lines has tenant, prompt and output_tokens after the log prefix, so a recorded day of
traffic replays as it came (in order, at the rate given).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRACE_KINDS = ("chat", "rag")


@dataclass
class TraceRequest:
    arrival_s: float
    tenant: str
    prompt_token_ids: list[int]
    output_tokens: int


@dataclass(frozen=True)
class ChatShape:
    """Multi-tenant chat: each tenant has its own system prompt, shared by all its users'
    sessions; a session resends its conversation each turn. Tenants are Zipf-popular."""

    tenants_per_replica: int = 8
    system_tokens: tuple[int, int] = (400, 800)
    user_tokens: tuple[int, int] = (20, 120)
    output_tokens: tuple[int, int] = (20, 160)
    max_turns: int = 4
    zipf: float = 1.0


@dataclass(frozen=True)
class RagShape:
    """RAG: a short instruction, one of the tenant's documents (popular ones more often), a
    question. The document is the prefix worth caching."""

    tenants_per_replica: int = 2
    docs_per_tenant: int = 16
    instruction_tokens: int = 48
    doc_tokens: tuple[int, int] = (600, 1200)
    question_tokens: tuple[int, int] = (10, 40)
    output_tokens: tuple[int, int] = (30, 120)
    zipf: float = 1.1


def generate_trace(
    kind: str,
    num_replicas: int,
    *,
    requests_per_replica: int,
    rate_per_replica: float,
    seed: int = 0,
    vocab_size: int = 32000,
    tenants_per_replica: int | None = None,
) -> list[TraceRequest]:
    """A trace for a fleet of `num_replicas`: tenants, requests and the arrival rate all grow
    with the fleet, so each replica sees the same load at every size. `tenants_per_replica`
    overrides the shape's (8 for chat, 2 for rag)."""
    rng = random.Random(seed)
    num_requests = requests_per_replica * num_replicas
    arrivals = _poisson(rng, rate_per_replica * num_replicas)
    tokens = _TokenSource(rng, vocab_size)
    if kind == "chat":
        chat = ChatShape() if tenants_per_replica is None else ChatShape(tenants_per_replica=tenants_per_replica)
        requests = _chat(rng, tokens, chat, num_replicas)
    elif kind == "rag":
        rag = RagShape() if tenants_per_replica is None else RagShape(tenants_per_replica=tenants_per_replica)
        requests = _rag(rng, tokens, rag, num_replicas)
    else:
        raise ValueError(f"trace must be one of {', '.join(TRACE_KINDS)} or a file, got {kind!r}")
    return [
        TraceRequest(next(arrivals), tenant, prompt, output)
        for (tenant, prompt, output), _ in zip(requests, range(num_requests))
    ]


def load_trace(
    path: str | Path, *, rate: float, tokenize: Callable[[str], list[int]] | None = None, limit: int | None = None
) -> list[TraceRequest]:
    """Read a JSON-lines trace (or a server request log); see the module's docstring."""
    rng = random.Random(0)
    arrivals = _poisson(rng, rate)
    trace: list[TraceRequest] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        start = line.find("{")
        if start < 0:
            continue
        try:
            entry = json.loads(line[start:])
        except json.JSONDecodeError:
            continue  # another logger's line
        if not isinstance(entry, dict) or "output_tokens" not in entry:
            continue
        if entry.get("status", 200) != 200:
            continue
        prompt = entry.get("prompt_token_ids")
        if prompt is None:
            prompt = _logged_prompt(entry.get("prompt"), tokenize, f"{path}:{number}")
        arrival = entry.get("arrival_s")
        trace.append(
            TraceRequest(
                float(arrival) if arrival is not None else next(arrivals),
                str(entry.get("tenant") or ""),
                list(prompt),
                max(1, int(entry["output_tokens"])),
            )
        )
        if limit is not None and len(trace) >= limit:
            break
    if not trace:
        raise ValueError(f"{path}: no requests (lines with output_tokens and a prompt)")
    trace.sort(key=lambda r: r.arrival_s)
    return trace


def _logged_prompt(prompt: Any, tokenize: Callable[[str], list[int]] | None, where: str) -> list[int]:
    """A request log's prompt: text, or a list of prompts (one request's prompts, joined),
    each text or the string of a token-id list (prompts the client sent as ids)."""
    parts = prompt if isinstance(prompt, list) else [prompt]
    tokens: list[int] = []
    for part in parts:
        if not isinstance(part, str):
            raise ValueError(f"{where}: a line needs prompt_token_ids or prompt text")
        if part.startswith("[") and part.endswith("]"):
            try:
                ids = json.loads(part)
            except json.JSONDecodeError:
                ids = None
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                tokens.extend(ids)
                continue
        if tokenize is None:
            raise ValueError(f"{where}: text prompts need --tokenizer")
        tokens.extend(tokenize(part))
    return tokens


def save_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    with open(path, "w") as f:
        for request in trace:
            f.write(json.dumps(asdict(request)) + "\n")


class _TokenSource:
    def __init__(self, rng: random.Random, vocab_size: int) -> None:
        self.rng = rng
        self.vocab_size = vocab_size

    def tokens(self, length_range: tuple[int, int]) -> list[int]:
        length = self.rng.randint(*length_range)
        return [self.rng.randrange(5, self.vocab_size) for _ in range(length)]


def _poisson(rng: random.Random, rate: float) -> Iterator[float]:
    now = 0.0
    while True:
        now += rng.expovariate(rate)
        yield now


def _zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(count)]


def _chat(
    rng: random.Random, tokens: _TokenSource, shape: ChatShape, num_replicas: int
) -> Iterator[tuple[str, list[int], int]]:
    num_tenants = shape.tenants_per_replica * num_replicas
    systems = [tokens.tokens(shape.system_tokens) for _ in range(num_tenants)]
    weights = _zipf_weights(num_tenants, shape.zipf)
    # Per tenant, its open sessions: the conversation so far and the turns left.
    sessions: dict[int, list[tuple[list[int], int]]] = {}
    while True:
        tenant = rng.choices(range(num_tenants), weights)[0]
        open_sessions = sessions.setdefault(tenant, [])
        if open_sessions and rng.random() < 0.5:
            history, turns_left = open_sessions.pop(rng.randrange(len(open_sessions)))
        else:
            history, turns_left = systems[tenant], rng.randint(1, shape.max_turns)
        prompt = history + tokens.tokens(shape.user_tokens)
        output = tokens.tokens(shape.output_tokens)
        if turns_left > 1:
            open_sessions.append((prompt + output, turns_left - 1))
        yield f"tenant-{tenant}", prompt, len(output)


def _rag(
    rng: random.Random, tokens: _TokenSource, shape: RagShape, num_replicas: int
) -> Iterator[tuple[str, list[int], int]]:
    num_tenants = shape.tenants_per_replica * num_replicas
    instruction = tokens.tokens((shape.instruction_tokens, shape.instruction_tokens))
    docs = [[tokens.tokens(shape.doc_tokens) for _ in range(shape.docs_per_tenant)] for _ in range(num_tenants)]
    doc_weights = _zipf_weights(shape.docs_per_tenant, shape.zipf)
    while True:
        tenant = rng.randrange(num_tenants)
        doc = rng.choices(docs[tenant], doc_weights)[0]
        yield (
            f"tenant-{tenant}",
            instruction + doc + tokens.tokens(shape.question_tokens),
            rng.randint(*shape.output_tokens),
        )


def trace_summary(trace: list[TraceRequest]) -> dict[str, Any]:
    prompt = sum(len(r.prompt_token_ids) for r in trace)
    return {
        "requests": len(trace),
        "tenants": len({r.tenant for r in trace}),
        "duration_s": round(trace[-1].arrival_s, 3) if trace else 0.0,
        "mean_prompt_tokens": round(prompt / max(len(trace), 1), 1),
        "mean_output_tokens": round(sum(r.output_tokens for r in trace) / max(len(trace), 1), 1),
    }
