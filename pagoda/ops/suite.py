"""Gate suites: JSONL files of prompts / conversations and of deliberately bad requests.

One JSON object per line. A generation case::

    {"id": "code-fib", "prompt": "def fib(n):", "max_tokens": 32, "tags": ["code"]}
    {"id": "chat-1", "messages": [{"role": "user", "content": "hi"}], "expected": "...",
     "schema": {...JSON schema...}, "stop": ["\\n\\n"]}

`prompt` (text or token ids) or `messages` is required; `expected` (an exact greedy output),
`schema` (the case is also sent with `response_format: json_schema` and the reply validated),
`tags`, `max_tokens` (default 32) and `stop` are optional. A bad request::

    {"id": "bad-temp", "bad_request": {"endpoint": "completions",
     "body": {"prompt": "x", "temperature": -1}}, "expect_status": 400}

`endpoint` is `completions`, `chat`, `tokenize` or a path; `body` gets the model filled in
unless it names one; `raw` instead of `body` sends those exact bytes (malformed JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_MAX_TOKENS = 32
DEFAULT_SUITE = "default"


class SuiteError(ValueError):
    """A suite file a user wrote is malformed; the message names the line."""


@dataclass
class SuiteCase:
    id: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    expected: str | None = None
    schema: dict[str, Any] | None = None
    tags: list[str] = field(default_factory=list)
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: list[str] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"id": self.id}
        for name in ("prompt", "messages", "expected", "schema", "stop"):
            if getattr(self, name) is not None:
                row[name] = getattr(self, name)
        if self.tags:
            row["tags"] = self.tags
        if self.max_tokens != DEFAULT_MAX_TOKENS:
            row["max_tokens"] = self.max_tokens
        return row


@dataclass
class BadRequestCase:
    id: str
    endpoint: str
    expect_status: int
    body: dict[str, Any] | None = None
    raw: str | None = None
    tags: list[str] = field(default_factory=list)

    @property
    def path(self) -> str:
        return {"completions": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize"}.get(
            self.endpoint, self.endpoint
        )

    def to_json(self) -> dict[str, Any]:
        request: dict[str, Any] = {"endpoint": self.endpoint}
        if self.raw is not None:
            request["raw"] = self.raw
        else:
            request["body"] = self.body or {}
        row: dict[str, Any] = {"id": self.id, "bad_request": request, "expect_status": self.expect_status}
        if self.tags:
            row["tags"] = self.tags
        return row


@dataclass
class Suite:
    name: str
    cases: list[SuiteCase] = field(default_factory=list)
    bad_requests: list[BadRequestCase] = field(default_factory=list)

    def with_max_tokens(self, max_tokens: int | None) -> Suite:
        """The suite with every case's max_tokens capped (shorter gate runs)."""
        if max_tokens is None:
            return self
        cases = [SuiteCase(**{**c.__dict__, "max_tokens": min(c.max_tokens, max_tokens)}) for c in self.cases]
        return Suite(self.name, cases, list(self.bad_requests))

    def write(self, path: str | Path) -> None:
        rows = [c.to_json() for c in self.cases] + [b.to_json() for b in self.bad_requests]
        Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _parse_case(row: dict[str, Any], where: str) -> SuiteCase | BadRequestCase:
    case_id = str(row.get("id") or where)
    tags = row.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise SuiteError(f"{where}: tags must be a list of strings")
    if "bad_request" in row:
        request = row["bad_request"]
        if not isinstance(request, dict) or not isinstance(request.get("endpoint"), str):
            raise SuiteError(f"{where}: bad_request needs an endpoint")
        status = row.get("expect_status")
        if not isinstance(status, int) or not 100 <= status <= 599:
            raise SuiteError(f"{where}: expect_status must be an HTTP status code")
        body, raw = request.get("body"), request.get("raw")
        if (body is None) == (raw is None):
            raise SuiteError(f"{where}: bad_request needs exactly one of body or raw")
        if body is not None and not isinstance(body, dict):
            raise SuiteError(f"{where}: bad_request.body must be an object")
        return BadRequestCase(case_id, request["endpoint"], status, body, raw, tags)
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise SuiteError(f"{where}: give exactly one of prompt or messages")
    if prompt is not None and not (
        isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    ):
        raise SuiteError(f"{where}: prompt must be a string or a list of token ids")
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise SuiteError(
            f"{where}: messages must be a non-empty list of {{{{role, content}}}} objects with string content"
        )
    max_tokens = row.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise SuiteError(f"{where}: max_tokens must be a positive integer")
    schema = row.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise SuiteError(f"{where}: schema must be a JSON schema object")
    stop = row.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    return SuiteCase(case_id, prompt, messages, row.get("expected"), schema, tags, max_tokens, stop)


def parse_suite(lines: Iterable[str], name: str) -> Suite:
    suite = Suite(name)
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        where = f"{name}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SuiteError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise SuiteError(f"{where}: each line must be a JSON object")
        case = _parse_case(row, where)
        if case.id in seen:
            raise SuiteError(f"{where}: id {case.id!r} appears twice")
        seen.add(case.id)
        if isinstance(case, BadRequestCase):
            suite.bad_requests.append(case)
        else:
            suite.cases.append(case)
    if not suite.cases:
        raise SuiteError(f"{name}: the suite has no prompts")
    return suite


def load_suite(spec: str | Path) -> Suite:
    """A suite file, or the name of a suite shipped with pagoda (`default`)."""
    path = Path(spec)
    if not path.exists() and re.fullmatch(r"[a-z0-9_-]+", str(spec)):
        bundled = resources.files("pagoda.ops") / "data" / f"suite_{spec}.jsonl"
        if bundled.is_file():
            return parse_suite(bundled.read_text().splitlines(), str(spec))
    try:
        text = path.read_text()
    except OSError as exc:
        raise SuiteError(f"cannot read suite {spec}: {exc.strerror or exc}") from None
    return parse_suite(text.splitlines(), path.name)


# ---- recording ---------------------------------------------------------------------------------


def suite_from_text(
    text: str, name: str, *, by: str = "paragraph", max_tokens: int = DEFAULT_MAX_TOKENS, chat: bool = False
) -> Suite:
    """One case per paragraph (blank-line separated) or per line of a text file."""
    chunks = re.split(r"\n\s*\n", text) if by == "paragraph" else text.splitlines()
    prompts = [c.strip("\n") for c in chunks if c.strip()]
    cases = []
    for i, prompt in enumerate(prompts):
        case = SuiteCase(f"{name}-{i}", max_tokens=max_tokens, tags=["recorded"])
        if chat:
            case.messages = [{"role": "user", "content": prompt}]
        else:
            case.prompt = prompt
        cases.append(case)
    if not cases:
        raise SuiteError(f"{name}: no prompts in the text")
    return Suite(name, cases)


def _log_json(line: str) -> dict[str, Any] | None:
    """The JSON object of one request-log line (pagoda's logger prefix is skipped)."""
    start = line.find("{")
    if start < 0:
        return None
    try:
        row = json.loads(line[start:])
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and "endpoint" in row and "request_id" in row else None


def _logged_messages(prompt: str) -> list[dict[str, str]] | None:
    """A chat request's conversation as pagoda logs it (its messages as JSON), else None."""
    try:
        messages = json.loads(prompt)
    except json.JSONDecodeError:
        return None
    if (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    return None


def suite_from_request_log(lines: Iterable[str], name: str, *, max_tokens: int | None = None) -> tuple[Suite, int]:
    """Cases from a pagoda prompt-log file (`pagoda serve --log-prompts` writes them under
    `--prompt-log-dir`; the ordinary request log never holds prompts): every successful request's
    prompts, deduplicated. Returns the suite and how many lines had no prompt."""
    cases: list[SuiteCase] = []
    seen: set[str] = set()
    without_prompt = 0
    for line in lines:
        row = _log_json(line)
        if row is None or row.get("status", 200) != 200:
            continue
        prompts = row.get("prompt")
        if prompts is None:
            without_prompt += 1
            continue
        chat = "chat" in str(row.get("endpoint"))
        for prompt in prompts if isinstance(prompts, list) else [prompts]:
            messages = _logged_messages(prompt) if chat else None
            value: str | list[int] = prompt
            if re.fullmatch(r"\[\s*\d+(\s*,\s*\d+)*\s*\]", prompt):  # logged token ids
                value = json.loads(prompt)
            key = json.dumps(messages if messages is not None else value)
            if key in seen:
                continue
            seen.add(key)
            tokens = max_tokens or max(1, min(int(row.get("output_tokens") or 0) or DEFAULT_MAX_TOKENS, 256))
            case = SuiteCase(
                f"{name}-{len(cases)}", max_tokens=tokens, tags=["recorded", "chat" if chat else "completions"]
            )
            if messages is not None:
                case.messages = messages
            else:
                case.prompt = value
            cases.append(case)
    if not cases:
        hint = (
            " (this log has no prompts: give a prompt-log file, prompts-*.jsonl, which "
            "`pagoda serve --log-prompts` writes under --prompt-log-dir)"
            if without_prompt
            else ""
        )
        raise SuiteError(f"{name}: no prompts found in the log{hint}")
    return Suite(name, cases), without_prompt
