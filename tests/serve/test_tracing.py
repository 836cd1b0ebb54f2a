"""OpenTelemetry request spans (--otlp-traces-endpoint): received by an in-process OTLP/HTTP
collector with the client's traceparent as parent, phase children timed by the engine."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.outputs import RequestMetrics
from pagoda.sampling_params import SamplingParams
from pagoda.serve.observability.tracing import RequestTrace, otel_missing, request_phases
from server_utils import MODEL_NAME, build_tiny_model, start_server

pytestmark = pytest.mark.skipif(otel_missing() is not None, reason=f"the otel extra is not installed: {otel_missing()}")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


class Collector:
    """A tiny OTLP/HTTP receiver: POST /v1/traces bodies decoded as protobuf, spans kept."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans: list[Any] = []
        self.spans = spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, name: str, count: int, timeout_s: float = 60) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [s for s in self.spans if s.name == name]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{count} {name!r} spans not received: {[s.name for s in self.spans]}")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = (
            [v.string_value for v in value.array_value.values] if kind == "array_value" else getattr(value, kind)
        )
    return out


def test_spans_reach_the_collector_with_the_callers_parent(tmp_path: Path) -> None:
    """Through the real flag path: ServerSettings.otlp_traces_endpoint -> OTLP/HTTP exporter."""
    collector = Collector()
    live = start_server(build_tiny_model(tmp_path / "model"), otlp_traces_endpoint=collector.url)
    try:
        response = httpx.post(
            live.url + "/v1/completions",
            headers={"traceparent": TRACEPARENT},
            json={"model": MODEL_NAME, "prompt": "def f():", "max_tokens": 4, "ignore_eos": True, "temperature": 0},
            timeout=60,
        )
        response.raise_for_status()
        request_id = response.json()["id"]
        httpx.post(
            live.url + "/v1/chat/completions",
            timeout=60,
            json={  # no traceparent
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "stream": True,
            },
        ).raise_for_status()
        live.app.state.ctx.tracer.force_flush()
        roots = collector.wait_for("llm_request", 2)
    finally:
        live.stop()
        collector.stop()
    [traced] = [s for s in roots if attributes(s)["gen_ai.request.id"] == request_id]
    assert traced.trace_id.hex() == TRACE_ID and traced.parent_span_id.hex() == PARENT_SPAN_ID
    attrs = attributes(traced)
    assert attrs["gen_ai.response.model"] == MODEL_NAME
    assert attrs["pagoda.provenance_id"] == request_id
    assert attrs["gen_ai.usage.completion_tokens"] == 4 and attrs["gen_ai.usage.prompt_tokens"] > 0
    assert attrs["gen_ai.request.max_tokens"] == 4 and attrs["gen_ai.request.temperature"] == 0
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    for key in (
        "gen_ai.latency.time_in_queue",
        "gen_ai.latency.time_to_first_token",
        "gen_ai.latency.e2e",
        "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode",
    ):
        assert attrs[key] >= 0, key
    children = {
        s.name: s for s in collector.spans if s.trace_id == traced.trace_id and s.parent_span_id == traced.span_id
    }
    assert set(children) == {"queue", "prefill", "decode"}
    queue, prefill, decode = children["queue"], children["prefill"], children["decode"]
    assert traced.start_time_unix_nano == queue.start_time_unix_nano  # the request's arrival
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert decode.end_time_unix_nano <= traced.end_time_unix_nano
    [untraced] = [s for s in roots if s is not traced]
    assert untraced.trace_id.hex() != TRACE_ID and not untraced.parent_span_id  # a trace of its own


def test_phases_come_from_the_engines_timestamps() -> None:
    """Several prompts: from the first to reach a point to the last to leave it; a disaggregated
    request gets its KV handoff."""
    first = RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.5,
        first_token_time=101.0,
        last_token_time=103.0,
        finished_time=103.0,
    )
    second = RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.7,
        first_token_time=101.5,
        last_token_time=104.0,
        finished_time=104.0,
        handoff_start_time=100.2,
        handoff_end_time=100.6,
    )
    trace = RequestTrace(
        request_id="r",
        provenance_id="r",
        endpoint="completions",
        model="m",
        tenant=None,
        status=200,
        params=SamplingParams(),
        arrival_time=100.0,
        end_time=104.1,
        timings=[first, second],
    )
    assert [(p.name, p.start, p.end) for p in request_phases(trace)] == [
        ("queue", 100.0, 100.5),
        ("handoff", 100.2, 100.6),
        ("prefill", 100.5, 101.0),
        ("decode", 101.0, 104.0),
    ]
    refused = RequestTrace(
        request_id="r",
        provenance_id="r",
        endpoint="completions",
        model="m",
        tenant=None,
        status=400,
        params=SamplingParams(),
        arrival_time=100.0,
        end_time=100.1,
        timings=[],
    )
    assert request_phases(refused) == []


def test_an_in_memory_exporter_sees_an_error_status() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from pagoda.serve.observability.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter, batch=False)
    tracer.record(
        RequestTrace(
            request_id="r",
            provenance_id="p",
            endpoint="chat",
            model="m",
            tenant="acme",
            status=503,
            params=SamplingParams(max_tokens=3),
            arrival_time=100.0,
            end_time=100.2,
            timings=[],
            error_code="engine_dead",
            headers={"traceparent": TRACEPARENT},
        )
    )
    tracer.shutdown()
    [span] = exporter.get_finished_spans()
    assert span.status.status_code == StatusCode.ERROR
    assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.attributes["pagoda.error_code"] == "engine_dead"
    assert span.attributes["pagoda.tenant"] == "acme"
    assert (span.end_time - span.start_time) == pytest.approx(0.2e9, rel=1e-3)


@pytest.mark.parametrize(
    "url, message",
    [
        ("localhost:4318", "--otlp-traces-endpoint must be an http:// or https:// URL"),
        ("ftp://collector/v1/traces", "--otlp-traces-endpoint must be an http:// or https:// URL"),
    ],
)
def test_a_bad_endpoint_exits_with_one_line(tmp_path: Path, url: str, message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(tmp_path), "--otlp-traces-endpoint", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"pagoda serve: {message}"), result.stderr


def test_without_the_sdk_the_flag_says_what_to_install(tmp_path: Path) -> None:
    """The SDK hidden from a child interpreter: one line naming the extra."""
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith('opentelemetry'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from pagoda.cli import main\n"
        f"sys.exit(main(['serve', '--model', {str(tmp_path)!r}, '--otlp-traces-endpoint', "
        "'http://127.0.0.1:4318/v1/traces']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert "pip install 'pagoda[otel]'" in line and line.startswith("pagoda serve: "), result.stderr
