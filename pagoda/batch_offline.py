"""`pagoda run-batch`: a JSONL file of OpenAI requests run offline through `pagoda.LLM`, in
vLLM's run-batch format.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with url
/v1/chat/completions, /v1/completions or /v1/embeddings; each output line is
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, in input
order, the body in the endpoint's OpenAI shape. Every valid line is tokenized and checked first,
then all of them run as one engine batch (the engine's continuous batching does the rest); a line
the engine would refuse, or one this runner cannot read, gets a status 400 and OpenAI's error body
instead of stopping the run. The server's Batch API (serve/batches/) answers the same lines
through the online endpoints; this one takes the common sampling fields and refuses the rest.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.engine.validation import validate_request
from pagoda.errors import InvalidRequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.llm import LLM

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Body fields taken as SamplingParams of the same name.
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# Body fields with nothing to do offline (one model, no stream, no user tracking).
INERT_FIELDS = (
    "model",
    "user",
    "stream",
    "stream_options",
    "metadata",
    "store",
    "service_tier",
    "priority",
    "encoding_format",
)
ROUTE_FIELDS = {
    "/v1/chat/completions": ("messages", "max_tokens", "max_completion_tokens"),
    "/v1/completions": ("prompt", "max_tokens"),
    "/v1/embeddings": ("input", "dimensions", "normalize"),
}


@dataclass(frozen=True)
class RunBatchOptions:
    """`pagoda run-batch`'s own flags (the engine's are an EngineConfig)."""

    input_file: str
    output_file: str
    pooling: str = "last"  # how /v1/embeddings lines pool the final hidden states


@dataclass
class RunBatchSummary:
    succeeded: int = 0
    failed: int = 0
    seconds: float = 0.0


class LineError(Exception):
    """A line answered with a 400 instead of running."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class _Line:
    custom_id: str
    url: str
    body: dict[str, Any]
    prompts: list[list[int]] = field(default_factory=list)
    params: SamplingParams | None = None
    error: LineError | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def _record(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": body.get("id", f"req_{uuid.uuid4().hex}"), "body": body},
        "error": None,
    }


def _error_body(error: LineError) -> dict[str, Any]:
    return {"error": {"message": str(error), "type": "invalid_request_error", "param": error.param, "code": error.code}}


def _sampling_params(llm: LLM, body: dict[str, Any], url: str, pooling: str) -> SamplingParams:
    known = set(SAMPLING_FIELDS) | set(INERT_FIELDS) | set(ROUTE_FIELDS[url])
    unknown = sorted(set(body) - known)
    if unknown:
        raise LineError(
            f"{unknown[0]} is not supported by pagoda run-batch.", param=unknown[0], code="unsupported_field"
        )
    if url == "/v1/embeddings":
        return SamplingParams(temperature=0.0, max_tokens=1, pooling=pooling)
    values = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    elif url == "/v1/chat/completions":
        values["max_tokens"] = None  # chat: up to the context length, as the server answers
    try:
        return dataclasses.replace(llm.get_default_sampling_params(), **values)
    except (InvalidRequest, ValueError, TypeError) as exc:
        raise LineError(str(exc), param=getattr(exc, "param", None)) from None


def _prompts(llm: LLM, body: dict[str, Any], url: str) -> list[list[int]]:
    tokenizer = llm.tokenizer
    if url == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise LineError("messages must be a non-empty list.", param="messages")
        try:
            return [tokenizer.encode_chat(messages)]
        except (InvalidRequest, ValueError, TypeError, KeyError) as exc:
            raise LineError(f"messages: {exc}", param="messages") from None
    name = "prompt" if url == "/v1/completions" else "input"
    value = body.get(name)
    items = (
        [value]
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value))
        else value
    )
    if not isinstance(items, list) or not items:
        raise LineError(f"{name} must be a string, token ids, or a non-empty list of either.", param=name)
    prompts = []
    for item in items:
        if isinstance(item, str) and item:
            prompts.append(tokenizer.encode(item, add_special_tokens=True))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            prompts.append(list(item))
        else:
            raise LineError(f"{name} must be a string, token ids, or a non-empty list of either.", param=name)
    return prompts


def _read_line(llm: LLM, raw: str, number: int, pooling: str) -> _Line:
    try:
        entry = json.loads(raw)
    except ValueError:
        return _Line(f"line-{number}", "", {}, error=LineError(f"line {number} is not JSON."))
    if not isinstance(entry, dict):
        return _Line(f"line-{number}", "", {}, error=LineError(f"line {number} is not a JSON object."))
    line = _Line(str(entry.get("custom_id") or f"line-{number}"), str(entry.get("url")), entry.get("body") or {})
    try:
        if entry.get("method", "POST") != "POST":
            raise LineError("method must be POST.", param="method")
        if line.url not in URLS:
            raise LineError(f"url must be one of {', '.join(URLS)}, got {line.url!r}.", param="url")
        if not isinstance(line.body, dict):
            raise LineError("body must be a JSON object.", param="body")
        line.params = _sampling_params(llm, line.body, line.url, pooling)
        line.prompts = _prompts(llm, line.body, line.url)
        for prompt in line.prompts:
            validate_request(prompt, line.params, llm.engine.engine_limits)
    except LineError as exc:
        line.error = exc
    except InvalidRequest as exc:
        line.error = LineError(str(exc), param=exc.param, code=getattr(exc, "code", None))
    return line


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _answer(line: _Line, model: str, created: int) -> dict[str, Any]:
    """The line's body in its endpoint's OpenAI shape."""
    outputs = line.outputs
    if line.url == "/v1/embeddings":
        dimensions, normalize = line.body.get("dimensions"), line.body.get("normalize", True)
        data = []
        for index, output in enumerate(outputs):
            vector = list(output.embedding or [])[:dimensions]
            if normalize:
                norm = sum(x * x for x in vector) ** 0.5 or 1.0
                vector = [x / norm for x in vector]
            data.append({"object": "embedding", "index": index, "embedding": vector})
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {
            "id": f"embd-{uuid.uuid4().hex}",
            "object": "list",
            "created": created,
            "model": model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    n = line.params.n if line.params is not None else 1
    if line.url == "/v1/chat/completions":
        choices = [
            {
                "index": sample.index,
                "message": {"role": "assistant", "content": sample.text},
                "logprobs": None,
                "finish_reason": sample.finish_reason,
            }
            for sample in outputs[0].outputs
        ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": _usage(outputs),
        }
    choices = [
        {"index": i * n + sample.index, "text": sample.text, "logprobs": None, "finish_reason": sample.finish_reason}
        for i, output in enumerate(outputs)
        for sample in output.outputs
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(outputs),
    }


def run_batch(
    llm: LLM, options: RunBatchOptions, model_name: str, progress: Callable[[str], None] | None = None
) -> RunBatchSummary:
    """Run `options.input_file`'s lines and write `options.output_file`; the counts of each outcome."""
    started = time.perf_counter()
    text = Path(options.input_file).read_text(encoding="utf-8")
    lines = [
        _read_line(llm, raw, number, options.pooling)
        for number, raw in enumerate(text.splitlines(), start=1)
        if raw.strip()
    ]
    runnable = [line for line in lines if line.error is None]
    prompts = [prompt for line in runnable for prompt in line.prompts]
    params = [line.params for line in runnable for _ in line.prompts]
    if progress is not None:
        progress(f"running {len(prompts)} prompts of {len(runnable)} lines ({len(lines) - len(runnable)} refused)")
    outputs = iter(llm.generate(prompts, params) if prompts else [])  # type: ignore[arg-type]
    for line in runnable:
        line.outputs = [next(outputs) for _ in line.prompts]
    created = int(time.time())
    summary = RunBatchSummary()
    with open(options.output_file, "w", encoding="utf-8") as out:
        for line in lines:
            if line.error is not None:
                record = _record(line.custom_id, 400, _error_body(line.error))
                summary.failed += 1
            else:
                record = _record(line.custom_id, 200, _answer(line, line.body.get("model") or model_name, created))
                summary.succeeded += 1
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary.seconds = time.perf_counter() - started
    return summary
