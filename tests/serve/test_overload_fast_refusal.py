"""While the admission queue is full, generation requests are refused before their body is read
(serve/admission/fast_refusal.py), with the endpoint's own 503, headers, metrics and log lines; a key that
does not authenticate still gets its 401 and a tenant over its own cap its 429; with room in the
queue, requests go through the app as before."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from pagoda.serve.admission.authentication import api_key_of
from pagoda.serve.admission.queue import QueueSlot
from pagoda.serve.admission.tenants import Tenant, TenantLimits, TenantRegistry
from pagoda.serve.admission.work import RequestWork
from pagoda.serve.endpoints import ENDPOINTS, Endpoint
from pagoda.serve.observability.request_log import LOGGER_NAME
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

QUEUE_LIMIT = 16
TENANTS = {"key-open": Tenant("open"), "key-capped": Tenant("capped", TenantLimits(max_concurrent_requests=1))}
HEADERS = {"Authorization": "Bearer key-open"}
COMPLETION = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(
        build_tiny_model(tmp_path_factory.mktemp("model")),
        engine={"max_num_seqs": 4},
        tenants=TenantRegistry(TENANTS),
        max_queued_requests=QUEUE_LIMIT,
    )
    yield live
    live.stop()


@pytest.fixture
def full_queue(server: LiveServer) -> Iterator[list[QueueSlot]]:
    """The queue holding its limit of sequences, as waiting requests would."""
    slots = server.app.state.ctx.admission.reserve(RequestWork(4, QUEUE_LIMIT // 4))
    yield slots
    for slot in slots:
        slot.leave()


def metric(server: LiveServer, name: str, reason: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    prefix = f'{name}{{model_name="{MODEL_NAME}",reason="{reason}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def refusal_counts(server: LiveServer) -> tuple[float, float]:
    return (
        metric(server, "pagoda:request_rejected_total", "overloaded"),
        metric(server, "pagoda:request_refusal_seconds_count", "overloaded"),
    )


def test_a_full_queue_refuses_without_reading_the_body(server: LiveServer, full_queue: list[QueueSlot]) -> None:
    rejected, timed = refusal_counts(server)
    # Not JSON at all: the app would answer 400, so only a refusal that never read it gives 503.
    response = httpx.post(server.base_url + "/completions", content=b"{not json", headers=HEADERS)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "server_overloaded" and error["code"] == "server_busy"
    assert error["param"] is None
    assert f"{QUEUE_LIMIT} sequences queued and 0 arriving (limit {QUEUE_LIMIT})" in error["message"]
    assert refusal_counts(server) == (rejected + 1, timed + 1)


def test_fast_and_admission_refusals_look_alike(server: LiveServer) -> None:
    """The admission path's 503 (one free slot, a request of two sequences) and the fast path's
    (no free slot) differ only in the message's numbers and in the fast path closing the
    connection whose body it did not read."""
    ctx = server.app.state.ctx
    slots = ctx.admission.reserve(RequestWork(1, QUEUE_LIMIT - 1))
    try:
        slow = httpx.post(server.base_url + "/completions", json={**COMPLETION, "n": 2}, headers=HEADERS)
        slots += ctx.admission.reserve(RequestWork(1, 1))
        fast = httpx.post(server.base_url + "/completions", json={**COMPLETION, "n": 2}, headers=HEADERS)
    finally:
        for slot in slots:
            slot.leave()
    assert slow.status_code == fast.status_code == 503
    assert "needs 2" in slow.json()["error"]["message"] and "needs" not in fast.json()["error"]["message"]
    assert sorted(slow.headers.keys()) == sorted(set(fast.headers.keys()) - {"connection"})
    assert fast.headers["connection"] == "close"
    for name in ("retry-after", "content-type"):
        assert slow.headers[name] == fast.headers[name]
    without_message = [{**r.json()["error"], "message": None} for r in (slow, fast)]
    assert without_message[0] == without_message[1]


QUEUEING = [endpoint for endpoint in ENDPOINTS if endpoint.queues_work]


def test_every_generation_endpoint_queues_work() -> None:
    assert {endpoint.path for endpoint in QUEUEING} == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/embeddings",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/classify",
        "/invocations",
    }


@pytest.mark.parametrize("endpoint", QUEUEING, ids=lambda endpoint: endpoint.path)
def test_each_generation_endpoint_refuses_in_its_own_shape(
    server: LiveServer, full_queue: list[QueueSlot], endpoint: Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """Every endpoint of the table that queues work is refused before its body is read: a body
    that is not JSON would be the app's 400."""
    rejected, timed = refusal_counts(server)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        response = httpx.request(
            endpoint.method, server.url + endpoint.path, content=b"{not json", headers={"x-api-key": "key-open"}
        )
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    if endpoint.anthropic:
        payload = response.json()
        assert payload["type"] == "error" and payload["error"]["type"] == "overloaded_error"
        assert "sequences queued" in payload["error"]["message"]
    else:
        assert response.json()["error"]["code"] == "server_busy"
    assert refusal_counts(server) == (rejected + 1, timed + 1)
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert line["endpoint"] == endpoint.name and line["status"] == 503


@pytest.mark.parametrize("path", [endpoint.path for endpoint in ENDPOINTS if not endpoint.queues_work])
def test_endpoints_that_queue_nothing_read_their_body(
    server: LiveServer, full_queue: list[QueueSlot], path: str
) -> None:
    response = httpx.post(server.url + path, content=b"{not json", headers=HEADERS)
    assert response.status_code == 400


def test_a_refusal_is_logged_as_at_admission(
    server: LiveServer, full_queue: list[QueueSlot], caplog: pytest.LogCaptureFixture
) -> None:
    access = logging.getLogger("uvicorn.access")
    access.addHandler(caplog.handler)  # uvicorn's access logger does not propagate
    level = access.level
    access.setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
            response = httpx.post(server.base_url + "/completions", json=COMPLETION, headers=HEADERS)
    finally:
        access.removeHandler(caplog.handler)
        access.setLevel(level)
    assert response.status_code == 503
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert line["endpoint"] == "completions" and line["tenant"] == "open"
    assert line["model"] == MODEL_NAME and line["status"] == 503
    assert line["request_id"].startswith("rejected-") and "sequences queued" in line["error"]
    assert any(
        r.name == "uvicorn.access" and "POST /v1/completions" in r.getMessage() and "503" in r.getMessage()
        for r in caplog.records
    )


def test_authentication_and_tenant_limits_keep_their_answers(server: LiveServer, full_queue: list[QueueSlot]) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-open"}):
        response = httpx.post(server.base_url + "/completions", json=COMPLETION, headers=headers)
        assert response.status_code == 401, headers
    ctx = server.app.state.ctx
    capped = ctx.settings.tenants.authenticate("key-capped")
    lease = ctx.limiter.acquire(capped, RequestWork(1))
    try:
        response = httpx.post(
            server.base_url + "/completions", json=COMPLETION, headers={"Authorization": "Bearer key-capped"}
        )
    finally:
        lease.release()
    assert response.status_code == 429 and response.json()["error"]["code"] == "rate_limit_exceeded"
    assert ctx.limiter.in_flight(capped) == 0  # the fast path's own hold was given back


def test_a_refused_connection_serves_the_next_request(server: LiveServer) -> None:
    """A refusal answered before its body was read closes its connection (the body's unread
    bytes are never taken for the next request's head); the client's next request is served."""
    ctx = server.app.state.ctx
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as client:
        slots = ctx.admission.reserve(RequestWork(1, QUEUE_LIMIT))
        try:
            refused = client.post("/completions", json={**COMPLETION, "prompt": "x" * 100_000})
        finally:
            for slot in slots:
                slot.leave()
        admitted = client.post("/completions", json=COMPLETION)
    assert refused.status_code == 503 and refused.headers["connection"] == "close"
    assert admitted.status_code == 200 and admitted.json()["usage"]["completion_tokens"] == 2


def test_with_room_in_the_queue_the_app_answers(server: LiveServer) -> None:
    bad = httpx.post(server.base_url + "/completions", content=b"{not json", headers=HEADERS)
    assert bad.status_code == 400
    assert httpx.post(server.base_url + "/completions", json=COMPLETION, headers=HEADERS).status_code == 200
    assert httpx.get(server.base_url + "/completions").status_code == 405  # only POSTs are refused early


def test_the_api_key_is_read_as_the_app_reads_it() -> None:
    assert api_key_of("Bearer  k1 ", None) == "k1"
    assert api_key_of("bearer k1", "k2") == "k1"
    assert api_key_of("Basic k1", "k2") is None  # an Authorization header that is not a key
    assert api_key_of(None, " k2 ") == "k2"
    assert api_key_of("", "") is None


def test_requests_still_arriving_count_against_the_queue() -> None:
    """In a burst every request passes the fast check before the first reaches admission:
    those past it and not yet admitted count as one sequence each, until admission or their end."""
    from pagoda.serve.admission.queue import AdmissionController, end_arrival

    controller = AdmissionController(max_queued_requests=2, max_queued_tokens=None)
    first, second = {}, {}
    controller.arrival_started(first)
    assert controller.refusal_of_any() is None
    controller.arrival_started(second)
    refusal = controller.refusal_of_any()
    assert refusal is not None and "0 sequences queued and 2 arriving (limit 2)" in refusal.message
    end_arrival(first)
    end_arrival(first)  # once per request
    assert controller.arriving == 1 and controller.refusal_of_any() is None
    end_arrival({})  # a request never counted
    assert controller.arriving == 1


def test_a_slow_arrival_stops_counting_after_the_window() -> None:
    """A client sending its body slowly cannot hold a queue slot past ARRIVAL_WINDOW_S."""
    from pagoda.serve.admission.queue import ARRIVAL_WINDOW_S, AdmissionController, end_arrival

    now = [100.0]
    controller = AdmissionController(max_queued_requests=1, max_queued_tokens=None, clock=lambda: now[0])
    slow = {}
    controller.arrival_started(slow)
    assert controller.refusal_of_any() is not None
    now[0] += ARRIVAL_WINDOW_S + 0.1
    assert controller.refusal_of_any() is None and controller.arriving == 0
    end_arrival(slow)  # it reaches admission at last: counted once, so nothing to give back
    assert controller.arriving == 0
