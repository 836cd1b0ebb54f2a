"""GET /dashboard (the page), its static assets, and /dashboard/events (one snapshot a second).

The page holds no data, so it is served to anyone; the figures come from /dashboard/events,
which authenticates like the API (Authorization: Bearer KEY). The page sends the key with a
fetch() stream rather than an EventSource, so the key stays out of URLs and access logs.
A tenant's key sees the server-wide figures (the ones /metrics publishes anyway) and only
its own tenant's rates and requests; an admin key (or an open server) sees every tenant.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagoda.serve.admission.tenants import Tenant, TenantRegistry
from pagoda.serve.api.sse import EventStreamResponse, sse_event, to_json
from pagoda.serve.dashboard.window import DashboardWindow
from pagoda.serve.errors import APIError
from pagoda.serve.observability.request_log import RequestLogger

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "index.html": "text/html"}


def _asset(name: str) -> bytes:
    return (resources.files("pagoda.serve.dashboard") / "static" / name).read_bytes()


def visible_tenants(tenant: Tenant, registry: TenantRegistry) -> list[str] | None:
    """None (every tenant) for an admin or an open server, else only the caller's tenant."""
    if registry.open_access or tenant.admin:
        return None
    return [tenant.name]


def install_dashboard(
    app: FastAPI,
    authenticate: Callable[[Request], Tenant],
    tenants: TenantRegistry,
    window: DashboardWindow,
    request_log: RequestLogger,
    interval_s: float = 1.0,
) -> None:
    """Add the dashboard's routes to `app`; `window` starts receiving the request records."""
    request_log.add_listener(window.observe_request)
    app.state.dashboard = window

    @app.get("/dashboard")
    async def dashboard_page() -> Response:
        return Response(_asset("index.html"), media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}")
    async def dashboard_asset(name: str) -> Response:
        if name not in _ASSETS:  # a fixed list: no path from the client reaches the disk
            raise APIError(404, f"No dashboard asset {name!r}.", type="not_found_error")
        return Response(_asset(name), media_type=_ASSETS[name])

    @app.get("/dashboard/snapshot")
    async def dashboard_snapshot(request: Request) -> Response:
        scope = visible_tenants(authenticate(request), tenants)
        return Response(to_json(window.snapshot(scope)), media_type="application/json")

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        scope = visible_tenants(authenticate(request), tenants)

        async def events() -> AsyncIterator[str]:
            while True:
                yield sse_event(window.snapshot(scope))
                await asyncio.sleep(interval_s)

        return EventStreamResponse(events(), on_close=lambda: None)
