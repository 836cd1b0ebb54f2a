"""Who is asking: the API key a request carries, the tenant it names, and the metrics token.

The app's routes and the full-queue refusal (fast_refusal.py) read the key the same way, so a
request is the same tenant whichever of them answers it."""

from __future__ import annotations

import hmac

from fastapi import Request

from pagoda.serve.admission.tenants import Tenant, TenantRegistry
from pagoda.serve.errors import unauthorized


def api_key_of(authorization: str | None, x_api_key: str | None) -> str | None:
    """The API key a request carries: `Authorization: Bearer KEY`, or (only without an
    Authorization header, as Anthropic's clients send it) `x-api-key: KEY`."""
    if authorization:
        scheme, _, key = authorization.partition(" ")
        return key.strip() if scheme.lower() == "bearer" else None
    return (x_api_key or "").strip() or None


def authenticate(tenants: TenantRegistry, request: Request) -> Tenant:
    """The tenant whose key `request` carries, or the 401 refusing it."""
    api_key = api_key_of(request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))
    tenant = tenants.authenticate(api_key)
    if tenant is None:
        raise unauthorized("Missing API key." if not api_key else "Invalid API key.")
    return tenant


def check_metrics_token(request: Request, token: str) -> None:
    """--metrics-token: scrapers send Authorization: Bearer TOKEN (compared in constant time)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise unauthorized("Missing metrics token (Authorization: Bearer TOKEN, see --metrics-token).")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise unauthorized("Invalid metrics token.")
