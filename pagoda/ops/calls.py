"""The HTTP requests the gate sends, each turned into a plain result (never raises on HTTP
errors: a 500 is data the gate compares, not a crash)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagoda.http_client.sse import iter_sse_events
from pagoda.ops.suite import BadRequestCase, SuiteCase
from pagoda.ops.target import Target
from pagoda.serve.observability.provenance import HEADER as PROVENANCE_HEADER


@dataclass
class Tokenized:
    status: int
    tokens: list[int] = field(default_factory=list)
    token_strs: list[str] | None = None
    error: str | None = None

    @property
    def supported(self) -> bool:
        return self.status not in (404, 405, 501)


@dataclass
class Completion:
    """One greedy, non-streamed generation."""

    status: int
    text: str = ""
    tokens: list[str] | None = None  # token strings, when the server returned logprobs
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    body: dict[str, Any] | None = None
    provenance_id: str | None = None  # pagoda's x-pagoda-provenance header

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class Streamed:
    """One streamed generation: every parsed chunk, in order."""

    status: int
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    malformed: list[str] = field(default_factory=list)
    error: str | None = None
    ttft: float | None = None


def error_message(response: httpx.Response) -> str:
    try:
        payload = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:200] or f"HTTP {response.status_code}"
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))[:200]
    return str(err or payload)[:200]


def tokenize(client: httpx.Client, target: Target, case: SuiteCase) -> Tokenized:
    body: dict[str, Any] = {"model": target.model, "return_token_strs": True}
    if case.is_chat:
        body["messages"] = case.messages
        body["add_generation_prompt"] = True
    else:
        body["prompt"] = case.prompt
    try:
        response = client.post(target.url("/tokenize"), json=body, headers=target.headers())
    except httpx.HTTPError as exc:
        return Tokenized(0, error=f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return Tokenized(response.status_code, error=error_message(response))
    payload = response.json()
    tokens = payload.get("tokens") if isinstance(payload, dict) else None
    if not tokens:
        # Another /tokenize shape (llama.cpp's takes `content`): comparing it would compare
        # nothing, so it counts as no /tokenize rather than as an empty tokenization.
        return Tokenized(501, error="/tokenize answered without tokens (not vLLM's shape)")
    return Tokenized(200, [int(t) for t in tokens], payload.get("token_strs"))


def generation_body(
    target: Target, case: SuiteCase, *, stream: bool = False, logprobs: bool = True
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": target.model, "max_tokens": case.max_tokens, "temperature": 0.0, "stream": stream}
    if case.stop:
        body["stop"] = case.stop
    if stream:
        body["stream_options"] = {"include_usage": True}
    if case.is_chat:
        body["messages"] = case.messages
        if logprobs:
            body["logprobs"] = True
        return "/v1/chat/completions", body
    body["prompt"] = case.prompt
    if logprobs:
        body["logprobs"] = 1
    return "/v1/completions", body


def _parse_completion(payload: dict[str, Any], chat: bool) -> Completion:
    choice = (payload.get("choices") or [{}])[0]
    result = Completion(200, finish_reason=choice.get("finish_reason"), usage=payload.get("usage"), body=payload)
    if chat:
        result.text = (choice.get("message") or {}).get("content") or ""
        content = (choice.get("logprobs") or {}).get("content")
        if content is not None:
            result.tokens = [str(entry.get("token")) for entry in content]
            result.logprobs = [float(entry.get("logprob")) for entry in content]
    else:
        result.text = choice.get("text") or ""
        logprobs = choice.get("logprobs") or {}
        if logprobs.get("tokens") is not None:
            result.tokens = [str(t) for t in logprobs["tokens"]]
            result.logprobs = [
                float(x) if x is not None else float("nan") for x in logprobs.get("token_logprobs") or []
            ]
    return result


def complete(
    client: httpx.Client, target: Target, case: SuiteCase, extra: dict[str, Any] | None = None, logprobs: bool = True
) -> Completion:
    path, body = generation_body(target, case, logprobs=logprobs)
    body.update(extra or {})
    try:
        response = client.post(target.url(path), json=body, headers=target.headers())
    except httpx.HTTPError as exc:
        return Completion(0, error=f"{type(exc).__name__}: {exc}")
    if response.status_code != 200:
        return Completion(response.status_code, error=error_message(response))
    try:
        result = _parse_completion(response.json(), case.is_chat)
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        return Completion(200, error=f"malformed response: {exc}")
    result.provenance_id = response.headers.get(PROVENANCE_HEADER)
    return result


def provenance(client: httpx.Client, target: Target, provenance_id: str) -> dict[str, Any]:
    """What served the request `provenance_id` names (GET /admin/provenance/ID: the server's
    operator key, or an open server); the id alone, and why, when the server does not say."""
    try:
        response = client.get(target.url(f"/admin/provenance/{provenance_id}"), headers=target.headers())
    except httpx.HTTPError as exc:
        return {"id": provenance_id, "unavailable": f"{type(exc).__name__}: {exc}"}
    if response.status_code != 200:
        return {"id": provenance_id, "unavailable": f"HTTP {response.status_code}: {error_message(response)}"}
    try:
        record = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        record = None
    if not isinstance(record, dict):
        return {"id": provenance_id, "unavailable": "malformed provenance record"}
    return record


def stream(
    client: httpx.Client, target: Target, path: str, body: dict[str, Any], api_key: str | None = None
) -> Streamed:
    sent = time.perf_counter()
    try:
        with client.stream("POST", target.url(path), json=body, headers=target.headers(api_key)) as response:
            result = Streamed(response.status_code)
            if response.status_code != 200:
                response.read()
                result.error = error_message(response)
                return result
            # Lines that are not data (nor blank, nor comments) land in `malformed` as they come.
            for event in iter_sse_events(response.iter_lines(), result.malformed):
                if event.done:
                    result.done = True
                    continue
                if result.done:
                    result.malformed.append("data after [DONE]")
                try:
                    chunk = event.json()
                except json.JSONDecodeError:
                    result.malformed.append(event.data[:120])
                    continue
                if result.ttft is None and chunk.get("choices"):
                    result.ttft = time.perf_counter() - sent
                result.chunks.append(chunk)
            result.malformed = [line[:120] for line in result.malformed]
            return result
    except httpx.HTTPError as exc:
        return Streamed(0, error=f"{type(exc).__name__}: {exc}")


def send_bad_request(client: httpx.Client, target: Target, case: BadRequestCase) -> int:
    """The status a deliberately bad request gets (0 when the connection failed)."""
    headers = {**target.headers(), "Content-Type": "application/json"}
    if case.raw is not None:
        content = case.raw.encode()
    else:
        body = dict(case.body or {})
        body.setdefault("model", target.model)
        content = json.dumps(body).encode()
    try:
        return client.post(target.url(case.path), content=content, headers=headers).status_code
    except httpx.HTTPError:
        return 0
