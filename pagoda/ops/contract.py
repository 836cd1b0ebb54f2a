"""API contract checks on one server: usage arithmetic, streaming shape, error codes.

Every check yields a one-line failure naming the case, so a broken candidate's report lists
exactly what a client would trip over.
"""

from __future__ import annotations

from typing import Any

import httpx

from pagoda.ops.calls import Completion, Tokenized, generation_body, send_bad_request, stream
from pagoda.ops.suite import BadRequestCase, SuiteCase
from pagoda.ops.target import Target

FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls", "function_call", "abort"}


def usage_failures(case: SuiteCase, result: Completion, tokenized: Tokenized | None) -> list[str]:
    """Usage numbers that do not add up for one non-streamed greedy result."""
    if not result.ok:
        return [f"{case.id}: HTTP {result.status}: {result.error}"]
    failures = []
    where = case.id
    if result.finish_reason not in FINISH_REASONS:
        failures.append(f"{where}: finish_reason {result.finish_reason!r} is not an OpenAI value")
    usage = result.usage
    if not isinstance(usage, dict):
        return failures + [f"{where}: response has no usage"]
    try:
        prompt, completion, total = (
            int(usage["prompt_tokens"]),
            int(usage["completion_tokens"]),
            int(usage["total_tokens"]),
        )
    except (KeyError, TypeError, ValueError):
        return failures + [f"{where}: usage lacks prompt/completion/total_tokens: {usage}"]
    if total != prompt + completion:
        failures.append(
            f"{where}: usage total_tokens {total} != prompt_tokens {prompt} + completion_tokens {completion}"
        )
    if completion > case.max_tokens:
        failures.append(f"{where}: completion_tokens {completion} > max_tokens {case.max_tokens}")
    if result.finish_reason == "length" and completion != case.max_tokens:
        failures.append(
            f"{where}: finish_reason length but completion_tokens {completion} != max_tokens {case.max_tokens}"
        )
    if result.tokens is not None and len(result.tokens) != completion:
        failures.append(f"{where}: completion_tokens {completion} but {len(result.tokens)} tokens carry logprobs")
    if tokenized is not None and tokenized.status == 200 and len(tokenized.tokens) != prompt:
        failures.append(f"{where}: prompt_tokens {prompt} but /tokenize counts {len(tokenized.tokens)}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None and not 0 <= int(cached) <= prompt:
        failures.append(f"{where}: cached_tokens {cached} outside [0, prompt_tokens {prompt}]")
    return failures


def _stream_text(chunk: dict[str, Any], chat: bool) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += ((choice.get("delta") or {}).get("content") or "") if chat else (choice.get("text") or "")
    return text


def stream_failures(client: httpx.Client, target: Target, case: SuiteCase, reference: Completion) -> list[str]:
    """Stream the case and check the SSE shape against OpenAI's and against the same request
    unstreamed (greedy, so the text and usage must agree)."""
    path, body = generation_body(target, case, stream=True, logprobs=False)
    result = stream(client, target, path, body)
    where = f"{case.id} (stream)"
    if result.status != 200 or result.error:
        return [f"{where}: HTTP {result.status}: {result.error}"]
    failures = [f"{where}: malformed SSE line {line!r}" for line in result.malformed[:3]]
    if not result.done:
        failures.append(f"{where}: stream did not end with data: [DONE]")
    chunks = result.chunks
    if not chunks:
        return failures + [f"{where}: no chunks"]
    expected_object = "chat.completion.chunk" if case.is_chat else "text_completion"
    objects = {c.get("object") for c in chunks}
    if objects != {expected_object}:
        failures.append(f"{where}: chunk object {sorted(map(str, objects))}, expected {expected_object!r}")
    if len({c.get("id") for c in chunks}) != 1:
        failures.append(f"{where}: chunks carry different ids")
    with_choices = [c for c in chunks if c.get("choices")]
    finishes = [ch.get("finish_reason") for c in with_choices for ch in c["choices"] if ch.get("finish_reason")]
    if len(finishes) != 1:
        failures.append(f"{where}: {len(finishes)} chunks set finish_reason (expected 1)")
    elif reference.ok and finishes[0] != reference.finish_reason:
        failures.append(f"{where}: finish_reason {finishes[0]!r} but {reference.finish_reason!r} unstreamed")
    if case.is_chat and with_choices:
        first = with_choices[0]["choices"][0].get("delta") or {}
        if first.get("role") != "assistant":
            failures.append(f"{where}: first delta has no role 'assistant'")
    usage = chunks[-1].get("usage")
    if not usage or chunks[-1].get("choices"):
        failures.append(f"{where}: include_usage set but the last chunk is not a usage chunk with empty choices")
    elif reference.ok and reference.usage:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if usage.get(key) != reference.usage.get(key):
                failures.append(f"{where}: usage {key} {usage.get(key)} but {reference.usage.get(key)} unstreamed")
    text = "".join(_stream_text(c, case.is_chat) for c in chunks)
    if reference.ok and text != reference.text:
        failures.append(
            f"{where}: streamed text differs from the unstreamed greedy text ({text[:40]!r} vs {reference.text[:40]!r})"
        )
    return failures


def bad_request_statuses(client: httpx.Client, target: Target, cases: list[BadRequestCase]) -> dict[str, int]:
    return {case.id: send_bad_request(client, target, case) for case in cases}


def bad_request_failures(cases: list[BadRequestCase], statuses: dict[str, int]) -> list[str]:
    return [
        f"{case.id}: {case.endpoint} answered {statuses[case.id]}, expected {case.expect_status}"
        for case in cases
        if statuses[case.id] != case.expect_status
    ]
