"""Every route of the built app asks for a key when keys are configured: only /health, and
/metrics without --metrics-token, answer without one (a route outside --api-key was vLLM's
/invocations). Keys are compared in constant time."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import httpx
import pytest
from starlette.routing import Mount, Route

from pagoda.serve.admission.tenants import TenantRegistry
from server_utils import LiveServer, build_tiny_model, start_server

KEYS = """
tenants:
  ops: {api_keys: [key-ops], admin: true}
  acme: {api_keys: [key-acme]}
"""
OPEN = {"/health", "/metrics"}
# The dashboard's page and its fixed static files hold no data (the figures come from
# /dashboard/events, which asks for the key): a browser loads them before it has a key to send.
STATIC_SHELL = {"/dashboard", "/dashboard/static/x"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("route-keys")
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS))
    live = start_server(
        build_tiny_model(root / "model"), tenants=TenantRegistry.from_file(keys), allow_runtime_lora=True
    )
    yield live
    live.stop()


def every_route(app) -> list[tuple[str, str]]:
    """(method, path) of every route, path parameters filled in."""
    found = []
    for route in app.routes:
        if isinstance(route, Mount):
            found.append(("GET", route.path.rstrip("/") + "/x"))
            continue
        assert isinstance(route, Route), route
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        for method in sorted((route.methods or {"GET"}) - {"HEAD"}):
            found.append((method, path))
    return found


def test_every_route_but_health_and_metrics_asks_for_a_key(server: LiveServer) -> None:
    routes = every_route(server.app)
    paths = {path for _, path in routes}
    assert {"/v1/chat/completions", "/v1/models", "/openapi.json", "/docs", "/invocations"} <= paths
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                response = client.request(method, path, headers=headers, json={} if method != "GET" else None)
                if path in OPEN:
                    assert response.status_code == 200, (method, path, response.text)
                elif path in STATIC_SHELL:
                    keyed = client.request(method, path, headers={"Authorization": "Bearer key-ops"})
                    assert response.status_code in (200, 404) and response.content == keyed.content
                else:
                    assert response.status_code == 401, (method, path, headers, response.status_code, response.text)
        assert client.get("/openapi.json", headers={"Authorization": "Bearer key-acme"}).status_code == 200
        assert client.get("/docs", headers={"x-api-key": "key-ops"}).status_code == 200


def test_keys_are_looked_up_in_constant_time(tmp_path: Path) -> None:
    """Each known key's digest is compared with hmac.compare_digest and none is skipped."""
    import hmac
    from unittest import mock

    registry = TenantRegistry.from_file(_keys(tmp_path))
    with mock.patch("pagoda.serve.admission.tenants.hmac.compare_digest", wraps=hmac.compare_digest) as compare:
        assert registry.authenticate("key-ops").name == "ops"
        assert compare.call_count == 2
        compare.reset_mock()
        assert registry.authenticate("key-nope") is None
        assert compare.call_count == 2


def _keys(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(textwrap.dedent(KEYS))
    return path
