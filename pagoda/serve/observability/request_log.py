"""One structured (JSON) log line per HTTP request that reached a generation endpoint.

Prompt and output text are never in it: they are the clients' data, not the operator's (with
--log-prompts they go, redacted, to the separate prompt log: prompt_log.py, a listener of this
logger). So is everything else a body carries: an error message keeps its own words but every
quoted span becomes its size (a role, a model name, a stop string), and errors about a field that
holds a grammar or a schema (whose compiler quotes it freely) keep only the field's name and the
message's size. The client's 4xx body is not touched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

LOGGER_NAME = "pagoda.serve.requests"

# A span between matching quotes that are not part of a word ("the server's" is no quote).
_QUOTED = re.compile(r"""(?<!\w)(['"`])(.*?)\1(?!\w)""", re.DOTALL)
# Fields whose errors quote the field's own text (schemas, grammars, tool definitions).
_STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_",
    "json_schema",
    "regex",
    "grammar",
    "tools",
    "tool_choice",
    "functions",
)


def redact_message(message: str, param: str | None = None) -> str:
    """`message` with nothing a client sent: quoted spans become their size, and the message of
    an error about a schema or grammar field becomes that field's name and the message's size."""
    if param is not None and any(part.startswith(_STRUCTURED_FIELDS) for part in param.split(".")):
        return f"invalid {param} (a {len(message)}-character message; the prompt log keeps it)"
    return _QUOTED.sub(lambda m: f"{m.group(1)}<{len(m.group(2))} chars>{m.group(1)}", message)


@dataclass
class RequestLogRecord:
    request_id: str
    endpoint: str
    tenant: str | None = None
    model: str | None = None
    status: int = 200
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    queue_time_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    finish_reason: str | None = None
    stream: bool = False
    error: str | None = None
    error_param: str | None = None  # the request field the error is about
    error_code: str | None = None  # the error's code (engine_dead, rate_limit_exceeded, ...)
    prompt: str | list[str] | None = None
    output: list[str] | None = None
    extra: dict[str, object] = field(default_factory=dict)
    # What served the request (serve/observability/provenance.py), once it reached the engine.
    provenance: dict[str, object] | None = None
    cost_usd: float | None = None  # by --price-table; None without one


class RequestLogger:
    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        # Called with every record whatever the log level (the live dashboard and the prompt
        # log read them).
        self._listeners: list[Callable[[RequestLogRecord], None]] = []

    def add_listener(self, listener: Callable[[RequestLogRecord], None]) -> None:
        self._listeners.append(listener)

    def log(self, record: RequestLogRecord) -> None:
        for listener in self._listeners:
            listener(record)
        if not self.logger.isEnabledFor(logging.INFO):
            return
        fields = dataclasses.asdict(record)
        fields.pop("prompt")
        fields.pop("output")
        if fields["error"] is not None:
            fields["error"] = redact_message(fields["error"], fields["error_param"])
        extra = fields.pop("extra")
        fields.update(extra)
        for key in ("queue_time_s", "ttft_s", "e2e_s"):
            if fields[key] is not None:
                fields[key] = round(fields[key], 6)
        if fields["cost_usd"] is not None:  # a short request costs millionths of a dollar
            fields["cost_usd"] = round(fields["cost_usd"], 12)
        line = json.dumps({k: v for k, v in fields.items() if v is not None}, ensure_ascii=False, separators=(",", ":"))
        self.logger.info(line)
