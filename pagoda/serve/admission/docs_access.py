"""/docs and /openapi.json behind the API key when keys are configured.

FastAPI serves both on its own, outside every route's authentication; with keys configured only
/health (and /metrics, per --metrics-token) stay open, so these ask for a key like every other
route (a route outside the key was vLLM's /invocations). Without keys they stay open."""

from __future__ import annotations

import json
from typing import Any

from pagoda.serve.admission.authentication import api_key_of
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.errors import unauthorized

DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json"})


class KeyedDocs:
    """ASGI middleware: a request for FastAPI's own documentation routes needs a valid key."""

    def __init__(self, app: Any, tenants: TenantRegistry) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in DOCS_PATHS or self.tenants.open_access:
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
        key = api_key_of(headers.get(b"authorization"), headers.get(b"x-api-key"))
        if self.tenants.authenticate(key) is not None:
            await self.app(scope, receive, send)
            return
        error = unauthorized("Missing API key." if not key else "Invalid API key.")
        body = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
