"""POST /invocations (SageMaker's one inference route), as vLLM serves it: the body's shape
picks the endpoint. Tried in vLLM's order, the first request model the body validates as
answers: chat completions (`messages`), then completions (`prompt`), then embeddings
(`input`). Each endpoint then answers exactly as on its own route."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.protocol import OpenAIRequest
from pagoda.serve.errors import bad_request


class InvocationRequest(OpenAIRequest):
    """Any JSON object: its members are read by the endpoint it is dispatched to."""


@dataclass(frozen=True)
class InvocationTarget:
    name: str  # the endpoint's route, for the error message
    body_model: type[pydantic.BaseModel]
    run: Callable[[Request, Any, Tenant], Awaitable[Response]]


def invocations(
    targets: Sequence[InvocationTarget],
) -> Callable[[Request, InvocationRequest, Tenant], Awaitable[Response]]:
    """The /invocations handler over `targets`, tried in order."""

    async def run(raw: Request, body: InvocationRequest, tenant: Tenant) -> Response:
        members = dict(body.model_extra or {})
        for target in targets:
            try:
                parsed = target.body_model.model_validate(members)
            except pydantic.ValidationError:
                continue
            return await target.run(raw, parsed, tenant)
        raise bad_request(
            "Cannot find a suitable handler for the request: the body must be one of "
            + ", ".join(f"{t.body_model.__name__} ({t.name})" for t in targets)
            + "."
        )

    return run
