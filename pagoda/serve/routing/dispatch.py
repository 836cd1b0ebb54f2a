"""From a request's `model` to the answer: resolve it (a route, a model's name or alias, a LoRA
adapter), then ask the model, and when it cannot answer (no live replica, shedding load with a
503, or its replica failing before the first token) its fallbacks in order, local models or
remote OpenAI-compatible endpoints. A remote that is down or slow is skipped and counted
(timeouts on connect and first byte), never waited on.

Every answer says how it was reached in `x-pagoda-route` (`model:NAME`, `route:ROUTE:NAME`,
`fallback:NAME`, `canary:NAME` for a live canary's candidate: routing/canary.py), which the
request log also carries as `route`; its `model` field names the
model that actually answered. A stream never switches models: it is handed to a fallback only
before its first token, and only then is anything sent to the client.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagoda.http_client.forward import ForwardFailed, forward_json
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.handler import GenerationEndpoint
from pagoda.serve.api.protocol import SamplingFields
from pagoda.serve.errors import APIError, bad_request, model_not_found
from pagoda.serve.model_registry import ModelRegistry, ServedModel
from pagoda.serve.models_file import RemoteEndpoint
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.serve.routing.canary import CanaryController, ShadowRequest
from pagoda.serve.routing.metrics import RoutingMetrics
from pagoda.serve.routing.rules import RequestFacts, first_match
from pagoda.serve.serving import ServeContext, new_request_id

ROUTE_HEADER = "x-pagoda-route"
# The endpoints a canary's shadow replays: their bodies are what `pagoda gate` compares.
SHADOWED_ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Resolved:
    """The model a request goes to first, and how it was chosen."""

    model: ServedModel
    label: str  # x-pagoda-route
    keeps_name: bool  # the request's `model` already names it (a name, alias or adapter)


class ModelDispatcher:
    def __init__(
        self,
        registry: ModelRegistry,
        metrics: RoutingMetrics,
        environ: Mapping[str, str] = os.environ,
        canary: CanaryController | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.canary = canary
        self._environ = environ

    def context_for(self, name: str | None, tenant: Tenant) -> tuple[ServeContext, str | None]:
        """The context of the model a non-generation request (tokenize, messages) names, and the
        name to give it there; a route is resolved by its rules without the request's text."""
        resolved = self._resolve(name, tenant, RequestFacts(tenant.name))
        return resolved.model.context, name if resolved.keeps_name else resolved.model.name

    async def generate(
        self,
        endpoint: GenerationEndpoint,
        path: str,
        raw: Request,
        body: SamplingFields,
        tenant: Tenant,
        *,
        handle: Callable[..., Awaitable[Response]] | None = None,
    ) -> Response:
        """Answer a generation request (completions, chat, Messages, Responses), by its model or
        a fallback. `handle`: the endpoint's answer (default `endpoint.handle`), called as
        `handle(ctx, raw, body, tenant, route=..., await_first_token=...)`."""
        handle = handle or endpoint.handle
        route = self.registry.route(body.model)
        facts = None
        if route is not None:
            facts = RequestFacts.of(tenant.name, body.model_dump(mode="json"), raw.headers)
        resolved = (
            await asyncio.to_thread(self._resolve, body.model, tenant, facts)
            if facts is not None and facts.prompt_text
            else self._resolve(body.model, tenant, facts)
        )
        chain: list[ServedModel | RemoteEndpoint] = [resolved.model, *self.registry.fallbacks(resolved.model, tenant)]
        if self.canary is not None and (
            route is not None or not resolved.keeps_name or body.model is None or body.model in resolved.model.names
        ):
            canary = self.canary
            canary.ensure_running()
            if canary.chooses_candidate(resolved.model, body.model, tenant.name):
                # The candidate's failure before its first token is stable's to answer.
                resolved = Resolved(canary.candidate, f"canary:{canary.candidate.name}", False)
                chain = [canary.candidate, *chain]
            elif resolved.model is canary.stable and endpoint.name in SHADOWED_ENDPOINTS:
                canary.offer_shadow(_shadow_request(endpoint.name, body))
        first_error: APIError | None = None
        for position, target in enumerate(chain):
            is_last = position == len(chain) - 1
            if isinstance(target, RemoteEndpoint):
                label = f"fallback:{target.label}"
                try:
                    response = await self._forward(target, endpoint.name, path, body, tenant, label)
                except ForwardFailed as failed:
                    self.metrics.record_remote_skip(target.url, failed.reason)
                    continue
                self.metrics.record_fallback(resolved.model.name, target.label, _reason(resolved.model, first_error))
                return response
            label = resolved.label if position == 0 else f"fallback:{target.name}"
            request = body if position == 0 and resolved.keeps_name else body.model_copy(update={"model": target.name})
            try:
                response = await handle(
                    target.context, raw, request, tenant, route=label, await_first_token=not is_last
                )
            except APIError as error:
                if error.status != 503 or is_last:
                    if first_error is not None and error.status == 503:
                        raise first_error from None
                    raise
                first_error = first_error or error
                continue
            if position > 0:
                self.metrics.record_fallback(resolved.model.name, target.name, _reason(resolved.model, first_error))
            response.headers[ROUTE_HEADER] = label
            return response
        assert first_error is not None  # the last target was remote and was skipped
        raise first_error

    def _resolve(self, name: str | None, tenant: Tenant, facts: RequestFacts | None) -> Resolved:
        registry = self.registry
        if name is None:
            return Resolved(registry.primary, f"model:{registry.primary.name}", True)
        if not registry.may_use(tenant, name):
            raise model_not_found(name)
        route = registry.route(name)
        if route is not None:
            match = first_match(route, facts or RequestFacts(tenant.name), self._count_tokens)
            if match is None:
                raise bad_request(
                    f"No rule of the route {name!r} matches this request.", param="model", code="no_route_matched"
                )
            model = registry.model(match.model)
            assert model is not None  # the registry checks every route's models
            if not registry.may_use(tenant, model.name):
                raise model_not_found(name)
            self.metrics.record_decision(route.name, model.name, match.rule_index)
            return Resolved(model, f"route:{route.name}:{model.name}", False)
        model = registry.model(name)
        if model is not None:
            return Resolved(model, f"model:{model.name}", True)
        owner = registry.model_with_adapter(name)  # its ServeContext checks the tenant may use it
        if owner is not None and registry.may_use(tenant, owner.name):
            return Resolved(owner, f"model:{owner.name}", True)
        raise model_not_found(name)

    def _count_tokens(self, model: str, text: str) -> int:
        served = self.registry.model(model)
        assert served is not None
        return len(served.llm.tokenizer.encode(text, add_special_tokens=False))

    async def _forward(
        self, remote: RemoteEndpoint, endpoint: str, path: str, body: SamplingFields, tenant: Tenant, label: str
    ) -> Response:
        """The remote's answer, relayed as it comes (ForwardFailed if it cannot give one)."""
        started = time.time()
        payload: dict[str, Any] = {
            **body.model_dump(mode="json", by_alias=True, exclude_unset=True),
            "model": remote.model,
        }
        api_key = self._environ.get(remote.api_key_env) if remote.api_key_env else None
        answer = await forward_json(
            remote.url + path.removeprefix("/v1"),
            payload,
            api_key=api_key,
            connect_timeout=remote.connect_timeout,
            first_byte_timeout=remote.first_byte_timeout,
        )
        log = self.registry.primary.context.request_log
        log.log(
            RequestLogRecord(
                request_id=new_request_id("remote"),
                endpoint=endpoint,
                tenant=tenant.name,
                model=remote.model,
                status=answer.status,
                stream=bool(body.stream),
                e2e_s=time.time() - started,
                extra={"route": label},
            )
        )
        headers = {ROUTE_HEADER: label}
        if body.stream:
            return StreamingResponse(answer.body(), media_type=answer.content_type, headers=headers)
        content = b"".join([chunk async for chunk in answer.body()])
        return Response(content, media_type=answer.content_type, headers=headers)


def _shadow_request(endpoint: str, body: SamplingFields) -> ShadowRequest:
    """What a shadow replay runs of `body`: its chat messages, or its prompt (a batch's first)."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    return ShadowRequest(endpoint, prompt=prompt, messages=getattr(body, "messages", None))


def _reason(model: ServedModel, error: APIError | None) -> str:
    """Why `model` did not answer: `error` is the 503 it gave (None: it was skipped)."""
    if not model.llm.is_alive:
        return "no_live_replica"
    if error is not None and error.code == "engine_dead":
        return "failed_before_first_token"
    return "overloaded"
