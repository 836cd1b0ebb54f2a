"""OpenTelemetry traces of requests (--otlp-traces-endpoint URL, the optional `otel` extra).

One span per generation request, `llm_request` (kind SERVER, as vLLM names it), with the
gen_ai.* attributes vLLM sets (model, request id, sampling, token counts, queue time, TTFT,
latencies) and the request's provenance id, and one child span per phase: `queue` (arrival to
first scheduled), `prefill` (to the first token), `decode` (to the last token) and, for a
request whose KV was handed over by a prefill engine, `handoff`. Every time comes from the
engine's per-request timestamps (RequestMetrics), the same ones the request log and the metrics
use; spans are built when the request ends and exported in batches off the event loop. The
parent is the client's W3C trace context (`traceparent` / `tracestate` headers); without one
the span starts a trace of its own.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pagoda.outputs import RequestMetrics
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
SERVICE_NAME = "pagoda"
# Spans leave in batches this often (and at exit).
EXPORT_DELAY_MS = 1000
_NS = 1_000_000_000


class SpanAttributes:
    """Attribute names: OpenTelemetry's gen_ai semantic conventions as vLLM uses them."""

    GEN_AI_SYSTEM = "gen_ai.system"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
    PAGODA_PROVENANCE_ID = "pagoda.provenance_id"
    PAGODA_ENDPOINT = "pagoda.endpoint"
    PAGODA_TENANT = "pagoda.tenant"
    PAGODA_ERROR_CODE = "pagoda.error_code"


def otel_missing() -> str | None:
    """Why tracing cannot run here (the SDK or the OTLP exporter is not installed), or None."""
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return (
                f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter "
                f"({module} is not installed): pip install 'pagoda[otel]'"
            )
    return None


def check_traces_endpoint(url: str) -> None:
    """ValueError (one line) for an endpoint that is not an http(s) URL, or without the SDK."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-traces-endpoint must be an http:// or https:// URL (the "
            f"collector's OTLP/HTTP traces endpoint, e.g. "
            f"http://localhost:4318/v1/traces), got {url!r}"
        )
    missing = otel_missing()
    if missing is not None:
        raise ValueError(missing)


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers of an incoming request (none: an empty dict)."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


@dataclass
class RequestTrace:
    """What one request's span is made of, gathered when the request ends."""

    request_id: str
    provenance_id: str
    endpoint: str
    model: str
    tenant: str | None
    status: int
    params: SamplingParams
    arrival_time: float  # time.time() when the request arrived
    end_time: float  # time.time() when it ended
    timings: list[RequestMetrics]  # one per prompt that reached the engine
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_sequences: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error_code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # the client's trace context


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float


def _earliest(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _latest(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def request_phases(trace: RequestTrace) -> list[Phase]:
    """queue, handoff, prefill and decode, as far as the request got (several prompts: from
    the first one to reach a point to the last one to leave it)."""
    timings = trace.timings
    scheduled = _earliest([m.first_scheduled_time for m in timings])
    first_token = _earliest([m.first_token_time for m in timings])
    last_token = _latest([m.last_token_time for m in timings])
    phases = []
    if scheduled is not None:
        phases.append(Phase("queue", trace.arrival_time, scheduled))
    handoff_start = _earliest([m.handoff_start_time for m in timings])
    handoff_end = _latest([m.handoff_end_time for m in timings])
    if handoff_start is not None and handoff_end is not None:
        phases.append(Phase("handoff", handoff_start, handoff_end))
    if scheduled is not None and first_token is not None:
        phases.append(Phase("prefill", scheduled, first_token))
    if first_token is not None and last_token is not None and last_token > first_token:
        phases.append(Phase("decode", first_token, last_token))
    return phases


def span_attributes(trace: RequestTrace) -> dict[str, Any]:
    a = SpanAttributes
    params = trace.params
    attributes: dict[str, Any] = {
        a.GEN_AI_SYSTEM: SERVICE_NAME,
        a.GEN_AI_RESPONSE_MODEL: trace.model,
        a.GEN_AI_REQUEST_ID: trace.request_id,
        a.PAGODA_PROVENANCE_ID: trace.provenance_id,
        a.PAGODA_ENDPOINT: trace.endpoint,
        a.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
        a.GEN_AI_REQUEST_TOP_P: params.top_p,
        a.GEN_AI_REQUEST_N: params.n,
        a.GEN_AI_USAGE_NUM_SEQUENCES: trace.num_sequences,
        a.GEN_AI_USAGE_PROMPT_TOKENS: trace.prompt_tokens,
        a.GEN_AI_USAGE_COMPLETION_TOKENS: trace.completion_tokens,
        a.GEN_AI_USAGE_CACHED_TOKENS: trace.cached_tokens,
        a.GEN_AI_LATENCY_E2E: trace.end_time - trace.arrival_time,
        a.HTTP_RESPONSE_STATUS_CODE: trace.status,
    }
    if params.max_tokens is not None:
        attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
    if trace.tenant is not None:
        attributes[a.PAGODA_TENANT] = trace.tenant
    if trace.finish_reasons:
        attributes[a.GEN_AI_RESPONSE_FINISH_REASONS] = trace.finish_reasons
    if trace.error_code is not None:
        attributes[a.PAGODA_ERROR_CODE] = trace.error_code
    phases = {p.name: p.end - p.start for p in request_phases(trace)}
    for name, key in (
        ("queue", a.GEN_AI_LATENCY_TIME_IN_QUEUE),
        ("prefill", a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL),
        ("decode", a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE),
    ):
        if name in phases:
            attributes[key] = phases[name]
    if "prefill" in phases:
        attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = phases["prefill"] + phases.get("decode", 0.0)
    first_token = _earliest([m.first_token_time for m in trace.timings])
    if first_token is not None:
        attributes[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token - trace.arrival_time
    return attributes


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


class RequestTracer:
    """Turns ended requests into spans and hands them to `exporter` (batched, off the event
    loop; `batch=False` exports each span at once, for tests). Needs the `otel` extra."""

    def __init__(self, exporter: SpanExporter, *, batch: bool = True, export_delay_ms: int = EXPORT_DELAY_MS) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=export_delay_ms)
            if batch
            else SimpleSpanProcessor(exporter)
        )
        self._tracer = self._provider.get_tracer("pagoda.serve")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracer:
        """Spans sent as OTLP/HTTP protobuf to `endpoint` (a collector's /v1/traces)."""
        check_traces_endpoint(endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint))

    def record(self, trace: RequestTrace) -> None:
        from opentelemetry import trace as otel_trace

        parent = self._propagator.extract(carrier=trace.headers)
        span = self._tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=otel_trace.SpanKind.SERVER,
            attributes=span_attributes(trace),
            start_time=_ns(trace.arrival_time),
        )
        if trace.status >= 500:
            span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR))
        inside = otel_trace.set_span_in_context(span)
        for phase in request_phases(trace):
            child = self._tracer.start_span(phase.name, context=inside, start_time=_ns(phase.start))
            child.end(end_time=_ns(max(phase.end, phase.start)))
        span.end(end_time=_ns(max(trace.end_time, trace.arrival_time)))

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()
