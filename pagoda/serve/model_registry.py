"""The models one server answers for: each model's engine client under its served name and
aliases, its fallbacks, and the routes (names that pick a model per request, serve/routing/).

One `pagoda serve --model M` is a registry of one model; `--models FILE` gives several. The HTTP
layer resolves every request's `model` here: a route, a model's name or alias, or a LoRA
adapter loaded on one of the models. Routes can be replaced while serving (`set_route`), so a
controller can re-weight traffic between models without touching the endpoints.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.client import EngineClient
from pagoda.serve.admission.tenants import Tenant, TenantLimiter
from pagoda.serve.models_file import CanarySpec, FallbackTarget, RemoteEndpoint, Route
from pagoda.serve.serving import ServeContext, ServerLogs
from pagoda.serve.settings import ServerSettings

# /health statuses of a client that takes requests.
SERVING_STATUSES = ("ok", "degraded")


@dataclass
class ServedModel:
    """One base model: its engine client, names and fallbacks (context: once the app is built)."""

    name: str  # canonical: the `model` of its answers
    llm: EngineClient
    model_path: str
    aliases: tuple[str, ...] = ()
    fallbacks: tuple[FallbackTarget, ...] = ()
    ctx: ServeContext | None = field(default=None, repr=False)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def context(self) -> ServeContext:
        assert self.ctx is not None, "ModelRegistry.bind has not run"
        return self.ctx


class ModelRegistry:
    """Served name / alias / route -> what answers it."""

    def __init__(
        self, models: Sequence[ServedModel], routes: Sequence[Route] = (), canary: CanarySpec | None = None
    ) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        self.models: dict[str, ServedModel] = {m.name: m for m in models}
        self.canary = canary  # the live canary the app runs (serve/routing/canary.py)
        self._by_name: dict[str, ServedModel] = {}
        for model in models:
            for name in model.names:
                if name in self._by_name:
                    raise ValueError(f"the model name {name!r} is taken twice")
                self._by_name[name] = model
        self._routes: dict[str, Route] = {}
        for route in routes:
            self.set_route(route)

    @classmethod
    def single(cls, llm: EngineClient, name: str, model_path: str, aliases: Sequence[str] = ()) -> ModelRegistry:
        """The registry of a server of one model (`pagoda serve --model`)."""
        return cls([ServedModel(name, llm, model_path, tuple(a for a in aliases if a != name))])

    @property
    def primary(self) -> ServedModel:
        """The first model: what endpoints without a model field (LoRA loading) act on."""
        return next(iter(self.models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)

    # ---- binding to an app -----------------------------------------------------------------

    def bind(self, settings: ServerSettings) -> None:
        """Give every model its ServeContext: `settings` under the model's own name, the tenant
        limiter and request log shared by all (a tenant's limits are the server's)."""
        from dataclasses import replace

        if len(self) == 1:  # the settings are the one model's own
            model = self.primary
            model.ctx = ServeContext.create(model.llm, settings, aliases=model.aliases)
            return
        limiter = TenantLimiter()
        logs = ServerLogs.create(settings)
        for model in self:
            model_settings = replace(settings, served_model_name=model.name, model_path=model.model_path)
            model.ctx = ServeContext.create(
                model.llm, model_settings, limiter=limiter, logs=logs, aliases=model.aliases
            )

    # ---- resolving names -------------------------------------------------------------------

    def set_route(self, route: Route) -> None:
        """Add or replace a route; every model it names must be served here."""
        if route.name in self._by_name:
            raise ValueError(f"the route {route.name!r} has a model's name")
        for rule in route.rules:
            if rule.model not in self._by_name:
                raise ValueError(f"route {route.name!r} sends requests to {rule.model!r}, which is not served here")
        self._routes[route.name] = route

    def route(self, name: str | None) -> Route | None:
        return self._routes.get(name) if name is not None else None

    @property
    def routes(self) -> list[Route]:
        return list(self._routes.values())

    def model(self, name: str) -> ServedModel | None:
        """The model a served name or alias names."""
        return self._by_name.get(name)

    def model_with_adapter(self, name: str) -> ServedModel | None:
        """The model that has LoRA adapter `name` loaded."""
        return next((m for m in self if name in m.llm.lora_names), None)

    def may_use(self, tenant: Tenant, name: str) -> bool:
        """Whether `tenant` may call `name`: a model by any of its names, a route, or an adapter
        of a model it may call (the adapter's own tenants are checked where it runs)."""
        if tenant.models is None:
            return True
        model = self._by_name.get(name) or (self.model_with_adapter(name) if name not in self._routes else None)
        return bool(tenant.models & set(model.names)) if model is not None else name in tenant.models

    def may_list_route(self, tenant: Tenant, route: Route) -> bool:
        """Whether /v1/models shows `route` to `tenant`: it may call the route, and every rule
        that can apply to it (its tenant among the rule's, if the rule names tenants) picks a
        model it may use; a route that could answer "does not exist" is not listed."""
        if not self.may_use(tenant, route.name):
            return False
        for rule in route.rules:
            if rule.tenants is not None and tenant.name not in rule.tenants:
                continue  # never this tenant's
            if not self.may_use(tenant, rule.model):
                return False
            if (
                rule.tasks is None
                and rule.classes is None
                and rule.min_prompt_tokens is None
                and rule.max_prompt_tokens is None
            ):
                return True  # always matches for this tenant: the rules after it never apply
        return True

    def fallbacks(self, model: ServedModel, tenant: Tenant) -> list[ServedModel | RemoteEndpoint]:
        """Where `model`'s requests go, in order, when it cannot answer (what `tenant` may use)."""
        if not tenant.allow_fallback:
            return []
        chain: list[ServedModel | RemoteEndpoint] = []
        for target in model.fallbacks:
            if target.remote is not None:
                chain.append(target.remote)
            elif target.model is not None:
                local = self._by_name[target.model]
                if self.may_use(tenant, local.name) and local not in chain:
                    chain.append(local)
        return chain

    # ---- what the server reports -----------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """One model: its client's /health body, as ever. Several: "ok" when all serve,
        "degraded" while some do, else the first one's status; each model's body under its name."""
        if len(self) == 1:
            return self.primary.llm.health()
        bodies = {model.name: model.llm.health() for model in self}
        serving = [name for name, body in bodies.items() if body.get("status") in SERVING_STATUSES]
        if len(serving) == len(bodies) and all(b.get("status") == "ok" for b in bodies.values()):
            status = "ok"
        elif serving:
            status = "degraded"
        else:
            status = next(iter(bodies.values())).get("status", "dead")
        return {"status": status, "models": bodies}

    @property
    def is_alive(self) -> bool:
        return any(model.llm.is_alive for model in self)

    @property
    def error(self) -> BaseException | None:
        return next((m.llm.error for m in self if m.llm.error is not None), None)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        for model in self:
            model.llm.shutdown(timeout)
