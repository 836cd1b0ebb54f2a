"""Overload refusals before the web framework: while the admission queue is full, a generation
request is answered 503 by an ASGI middleware in front of FastAPI, before its body is read.

Under a flood most requests are refused, so what a refusal costs is what the flood costs: going
through routing, the framework's request objects and body parsing only to be told "no" made the
refusals arrive late. `FastRefusal` answers them from what the connection already holds (the
method, the path and the headers) when `AdmissionController.refusal_of_any` says that no request,
whatever its size, would be admitted now. It refuses as `ServeContext.admit` would refuse a
one-sequence request: the key must authenticate (else the request goes on, to its 401), the
engine must be running (else to its engine_dead 503), and the tenant's limits are taken and
given back as for any refused request (their 429 wins over the queue's 503). The answer is the
one the endpoint gives (OpenAI's error shape, Anthropic's on /v1/messages, the same headers) and
is accounted the same way: the rejected-requests counter, the refusal-time histogram, the request
log line; the HTTP access line is the server's as for any response. The refusal time runs
from the middleware's entry to the answer's accounting, just before it is handed to the server
(what the server then spends writing it is in benchmarks/overload.py's CPU time per request).

What is not read cannot be judged: while the queue is full a body that would be a 400 (bad
JSON, more sequences than the queue can ever hold) or a model that does not exist gets this
503 instead; its retry gets the 400 or 404 once there is room.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pagoda.serve.admission.authentication import api_key_of
from pagoda.serve.admission.queue import end_arrival
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.admission.work import RequestWork
from pagoda.serve.endpoints import Endpoint
from pagoda.serve.errors import APIError, anthropic_error_body
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.serve.serving import ServeContext, new_request_id, rejection_reason

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

ONE_SEQUENCE = RequestWork(num_prompts=1, n=1)


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:  # ASGI servers hand header names over lower-cased
        if key == name:
            return value.decode("latin-1")
    return None


def json_bytes(content: Any) -> bytes:
    """`content` serialized byte for byte as Starlette's JSONResponse does."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    length = _header(headers, b"content-length")
    return _header(headers, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")


class FastRefusal:
    """ASGI middleware: while the queue is full, refuse the requests of every endpoint of
    `endpoints` that queues work (serve/endpoints.py) with the endpoint's own 503 before the app
    sees them; pass everything else on untouched."""

    def __init__(self, app: ASGIApp, ctx: ServeContext, endpoints: Iterable[Endpoint]) -> None:
        self.app = app
        self.ctx = ctx
        self.routes = {(endpoint.method, endpoint.path): endpoint for endpoint in endpoints if endpoint.queues_work}

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[None]]
    ) -> None:
        if scope["type"] == "http":
            route = self.routes.get((scope["method"], scope["path"]))
            if route is not None:
                started = time.perf_counter()
                refusal = self.ctx.admission.refusal_of_any()
                if refusal is not None:
                    refused = self._refusal(scope, refusal)
                    if refused is not None:
                        tenant, error = refused
                        # Accounted before the answer leaves, as the app does: a client that
                        # has its 503 finds it in /metrics and the log.
                        self._account(route, tenant, error, started)
                        await self._answer(send, route, error, _has_body(scope["headers"]))
                        return
                self.ctx.admission.arrival_started(scope)
                try:
                    await self.app(scope, receive, send)
                finally:  # when the request ended before reaching admission (a 400, a 401...)
                    end_arrival(scope)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: dict, queue_full: APIError) -> tuple[Tenant, APIError] | None:
        """The tenant and the error `ServeContext.admit` would raise for a one-sequence request
        now, or None when the request must go on to the app (an unknown key, a dead engine)."""
        ctx = self.ctx
        tenants = ctx.settings.tenants
        if tenants.open_access:
            tenant = tenants.authenticate(None)
        else:
            headers = scope["headers"]
            tenant = tenants.authenticate(
                api_key_of(_header(headers, b"authorization"), _header(headers, b"x-api-key"))
            )
        if tenant is None or not ctx.llm.is_alive:
            return None
        try:
            lease = ctx.limiter.acquire(tenant, ONE_SEQUENCE)
        except APIError as exc:  # the tenant's own limit: refused by it, as admit would
            return tenant, exc
        lease.release()
        return tenant, queue_full

    async def _answer(
        self, send: Callable[[dict], Awaitable[None]], route: Endpoint, error: APIError, body_unread: bool
    ) -> None:
        body = json_bytes(anthropic_error_body(error) if route.anthropic else error.body())
        headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
        headers += [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
        if body_unread:
            # The answer leaves before the request's body was read (RFC 9112 9.6: close after
            # answering a request whose body was not read). Kept alive, the server would have
            # to skip the rest of the body exactly; where part of it was still in flight, its
            # bytes were read as the next request's head (a 431 to the client's next request).
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _account(self, route: Endpoint, tenant: Tenant, error: APIError, started: float) -> None:
        """What the app records for a request refused at admission: its metrics and log line."""
        ctx = self.ctx
        assert route.name is not None  # every endpoint that queues work has one (Endpoint checks)
        reason = rejection_reason(error)
        ctx.metrics.record_rejected(reason)
        ctx.metrics.record_refusal_time(reason, time.perf_counter() - started)
        ctx.request_log.log(
            RequestLogRecord(
                request_id=new_request_id("rejected"),
                endpoint=route.name,
                tenant=tenant.name,
                model=ctx.model_name,
                status=error.status,
                error=error.message,
                error_param=error.param,
            )
        )
