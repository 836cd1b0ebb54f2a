"""Tenants: who is calling (API key -> tenant), what each may do, and rate limiting.

A keys file (YAML or JSON) lists tenants with their keys and limits::

    tenants:
      acme:
        api_keys: [sk-acme-1, sk-acme-2]
        requests_per_minute: 60
        tokens_per_minute: 20000      # prompt + generated tokens
        max_concurrent_requests: 4    # sequences at once: each prompt of a batch times n
        max_prompt_tokens: 2048
        max_output_tokens: 512
        priority: 0                   # lower runs first with --scheduling-policy priority
        priority_range: [0, 10]       # the request `priority` values it may send
        adapters: [acme-sql]          # LoRA adapters it may use (see below)
      ops:
        api_keys: [sk-ops]
        admin: true                   # sees every tenant's figures on /dashboard, loads LoRA adapters

A request's own `priority` (vLLM's field) must lie in the tenant's `priority_range`, or, when
the tenant has none, be no lower than its `priority`: a request outside is refused with a 400
naming the field (not clamped: the client learns its request would not run as asked). So a
tenant can order its own requests but never jump the queue past its floor. A request without
one runs at the tenant's `priority`.

Every limit is optional. Without a file the server is open (one tenant, "default"), or
guarded by a single `--api-key` shared by that one tenant.

The tenant also determines the prefix-cache salt, so cached blocks never leak between
tenants; the client has no say in it. An operator may deliberately let several tenants share
cached prefixes (e.g. one organisation's keys split for quotas) by giving them the same
`cache_scope: NAME`; the default scope is the tenant's own name. `pagoda audit` reports a
shared scope as a cross-tenant side channel.

LoRA adapters: a tenant that lists `adapters` may use exactly those (and the base model); an
adapter listed by any tenant belongs to the tenants listing it, and every other tenant gets a
404 model_not_found for it, as if it did not exist. Adapters no tenant lists are open to all.
An admin key without a list of its own may use every adapter (the operator's view).

Several models (`pagoda serve --models FILE`): a tenant that lists `models` may use exactly
those (by name, alias or route); others answer as if they did not exist. `allow_fallback: false`
keeps a tenant's requests on the model they name: no fallback to another model or endpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.serve.admission.work import RequestWork, never_fits
from pagoda.serve.errors import bad_request, rate_limited

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    priority: int = 0
    # The request priorities the tenant may ask for; None: its `priority` or any lower rank.
    priority_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "priority":
                if not _is_priority(value):
                    raise ValueError(f"priority must be an integer, got {value!r}")
            elif f.name == "priority_range":
                if value is None:
                    continue
                if (
                    not isinstance(value, (list, tuple))
                    or len(value) != 2
                    or not all(map(_is_priority, value))
                    or value[0] > value[1]
                ):
                    raise ValueError(f"priority_range must be [lowest, highest] integers, got {value!r}")
                object.__setattr__(self, "priority_range", (value[0], value[1]))
                if not value[0] <= self.priority <= value[1]:
                    raise ValueError(f"priority {self.priority} is outside priority_range {list(value)}")
            elif value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    # Tenants with the same scope share prefix-cache entries; None: the tenant's own name.
    cache_scope: str | None = None
    # An admin key sees every tenant's figures on /dashboard; others see only their own.
    admin: bool = False
    # LoRA adapters this tenant may use; None: those no tenant claims (an admin: all).
    adapters: frozenset[str] | None = None
    # Models (served names, aliases or routes) this tenant may use; None: every one.
    models: frozenset[str] | None = None
    allow_fallback: bool = True  # its requests may be answered by a model's fallbacks

    @property
    def cache_salt(self) -> str:
        scope = self.cache_scope or self.name
        return hashlib.sha256(f"pagoda-prefix-cache\0{scope}".encode()).hexdigest()[:32]

    def check_prompt_tokens(self, num_prompt_tokens: int) -> None:
        limit = self.limits.max_prompt_tokens
        if limit is not None and num_prompt_tokens > limit:
            raise bad_request(
                f"The prompt has {num_prompt_tokens} tokens, over this key's limit of {limit} prompt tokens.",
                param="prompt",
                code="prompt_too_long",
            )

    def resolve_priority(self, requested: Any) -> int:
        """The scheduling priority of a request that asked for `requested` (None: the tenant's
        own); a 400 naming `priority` when this key may not ask for it."""
        if requested is None:
            return self.limits.priority
        if not _is_priority(requested):
            raise bad_request(f"priority must be an integer, got {requested!r}.", param="priority")
        low, high = self.limits.priority_range or (self.limits.priority, None)
        if requested < low or (high is not None and requested > high):
            allowed = f"[{low}, {high}]" if high is not None else f"{low} or more (lower runs first)"
            raise bad_request(
                f"priority {requested} is outside this key's allowed priorities: {allowed}.", param="priority"
            )
        return requested

    def resolve_max_tokens(self, requested: int | None, param: str = "max_tokens") -> int | None:
        """The client's max_tokens under this tenant's cap (None: up to the context length)."""
        limit = self.limits.max_output_tokens
        if limit is None:
            return requested
        if requested is None:
            return limit
        if requested > limit:
            raise bad_request(f"{param} ({requested}) is over this key's limit of {limit} output tokens.", param=param)
        return requested


# Request priorities travel to the engine as 64-bit integers.
PRIORITY_BOUND = 2**63


def _is_priority(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -PRIORITY_BOUND <= value < PRIORITY_BOUND


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantRegistry:
    """API key -> tenant. `open_access` when no key is configured at all."""

    def __init__(self, keys: dict[str, Tenant] | None = None, open_tenant: Tenant | None = None) -> None:
        # Only digests are kept, so a dict lookup reveals nothing about the keys' bytes.
        self._by_digest = {_key_digest(k): t for k, t in (keys or {}).items()}
        self._open_tenant = open_tenant

    @classmethod
    def open(cls) -> TenantRegistry:
        return cls(open_tenant=Tenant(DEFAULT_TENANT))

    @classmethod
    def single_key(cls, key: str) -> TenantRegistry:
        return cls({key: Tenant(DEFAULT_TENANT, admin=True)})

    @classmethod
    def from_file(cls, path: str | Path) -> TenantRegistry:
        return cls(parse_tenants(load_keys_file(path)))

    @property
    def open_access(self) -> bool:
        return self._open_tenant is not None

    def may_use_adapter(self, tenant: Tenant, name: str) -> bool:
        """Whether `tenant` may run LoRA adapter `name` (see the module docstring)."""
        if tenant.adapters is not None:
            return name in tenant.adapters
        if tenant.admin:
            return True
        return not any(t.adapters and name in t.adapters for t in self._by_digest.values())

    def by_name(self, name: str) -> Tenant | None:
        """The tenant called `name` (what runs work stored under its name, e.g. a batch)."""
        if self._open_tenant is not None:
            return self._open_tenant if self._open_tenant.name == name else None
        return next((tenant for tenant in self._by_digest.values() if tenant.name == name), None)

    def authenticate(self, api_key: str | None) -> Tenant | None:
        if self._open_tenant is not None:
            return self._open_tenant
        if not api_key:
            return None
        # Every known key's digest compared in constant time, none skipped on a match: how long
        # this takes says nothing about how close a guess came (vLLM CVE-2025-59425).
        given = _key_digest(api_key)
        found = None
        for digest, tenant in self._by_digest.items():
            if hmac.compare_digest(digest, given):
                found = tenant
        return found


def load_keys_file(path: str | Path) -> Any:
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        return json.loads(text)
    import yaml  # YAML is a superset of JSON, so this reads both

    return yaml.safe_load(text)


_LIMIT_FIELDS = {f.name for f in dataclasses.fields(TenantLimits)}


def parse_tenants(data: Any) -> dict[str, Tenant]:
    """The keys file's content -> {api key: tenant}. Raises ValueError on anything malformed."""
    if not isinstance(data, dict) or "tenants" not in data:
        raise ValueError("the API keys file must be a mapping with a `tenants` entry")
    entries = data["tenants"]
    if isinstance(entries, dict):
        entries = [{"name": name, **(spec or {})} for name, spec in entries.items()]
    if not isinstance(entries, list):
        raise ValueError("`tenants` must be a mapping of name -> settings or a list")
    keys: dict[str, Tenant] = {}
    for spec in entries:
        if not isinstance(spec, dict) or not spec.get("name"):
            raise ValueError(f"each tenant needs a name, got {spec!r}")
        spec = dict(spec)
        name = str(spec.pop("name"))
        api_keys = spec.pop("api_keys", [])
        if "api_key" in spec:
            api_keys = [*api_keys, spec.pop("api_key")]
        admin = spec.pop("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"tenant {name!r}: admin must be true or false, got {admin!r}")
        cache_scope = spec.pop("cache_scope", None)
        if cache_scope is not None and (not isinstance(cache_scope, str) or not cache_scope):
            raise ValueError(f"tenant {name!r}: cache_scope must be a non-empty string")
        adapters = spec.pop("adapters", None)
        if adapters is not None and (
            not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters)
        ):
            raise ValueError(f"tenant {name!r}: adapters must be a list of LoRA adapter names")
        models = spec.pop("models", None)
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
            raise ValueError(f"tenant {name!r}: models must be a list of model names")
        allow_fallback = spec.pop("allow_fallback", True)
        if not isinstance(allow_fallback, bool):
            raise ValueError(f"tenant {name!r}: allow_fallback must be true or false, got {allow_fallback!r}")
        unknown = set(spec) - _LIMIT_FIELDS
        if unknown:
            raise ValueError(
                f"tenant {name!r}: unknown settings {sorted(unknown)}; "
                f"known: adapters, admin, allow_fallback, api_keys, cache_scope, models, "
                f"{', '.join(sorted(_LIMIT_FIELDS))}"
            )
        try:
            tenant = Tenant(
                name,
                TenantLimits(**spec),
                cache_scope=cache_scope,
                admin=admin,
                adapters=frozenset(adapters) if adapters is not None else None,
                models=frozenset(models) if models is not None else None,
                allow_fallback=allow_fallback,
            )
        except ValueError as exc:
            raise ValueError(f"tenant {name!r}: {exc}") from None
        if not api_keys:
            raise ValueError(f"tenant {name!r} has no api_keys")
        for key in api_keys:
            if not isinstance(key, str) or not key:
                raise ValueError(f"tenant {name!r}: API keys must be non-empty strings")
            if key in keys:
                raise ValueError(f"API key listed twice (tenants {keys[key].name!r} and {name!r})")
            keys[key] = tenant
    return keys


# ---- rate limiting ---------------------------------------------------------------------------


@dataclass
class TokenBucket:
    """Refills continuously to `capacity` at `capacity` per minute. May go into debt."""

    capacity: float
    level: float
    updated: float

    @property
    def refill_per_second(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.refill_per_second)
        self.updated = now

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) / self.refill_per_second)


@dataclass
class _TenantUsage:
    in_flight: int = 0  # sequences
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None


@dataclass
class TenantLease:
    """A tenant's hold on one admitted HTTP request: its sequences and, once the prompts are
    tokenized, its reserved tokens. `release` exactly once when it ends."""

    limiter: TenantLimiter
    tenant: Tenant
    num_sequences: int
    reserved_tokens: int = 0
    released: bool = False

    def reserve_tokens(self, work: RequestWork) -> None:
        """Take the request's estimated tokens from the quota, or raise a 400 / 429."""
        self.limiter._reserve_tokens(self, work)

    def release(self, used_tokens: int = 0) -> None:
        """End the hold; the quota gets back what the reservation held beyond `used_tokens`."""
        if not self.released:
            self.released = True
            self.limiter._release(self, used_tokens)


class TenantLimiter:
    """Requests/minute, tokens/minute and concurrency per tenant. Used from the event loop only.

    Concurrency counts sequences (every prompt of a batch times `n`), as --max-num-seqs does.
    Token quota: a request's estimated cost (prompt tokens + n x each prompt's output limit) is
    reserved when it is admitted, so no request overshoots the quota; when it ends the quota gets
    back what it did not use. A request that could not fit even a full quota, or more sequences
    than the cap, gets a 400 that says the limit; one that must wait, a 429 with Retry-After.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _TenantUsage] = {}

    def _usage_of(self, tenant: Tenant, now: float) -> _TenantUsage:
        usage = self._usage.get(tenant.name)
        if usage is None:
            limits = tenant.limits
            usage = _TenantUsage(
                requests=(
                    TokenBucket(limits.requests_per_minute, limits.requests_per_minute, now)
                    if limits.requests_per_minute
                    else None
                ),
                tokens=(
                    TokenBucket(limits.tokens_per_minute, limits.tokens_per_minute, now)
                    if limits.tokens_per_minute
                    else None
                ),
            )
            self._usage[tenant.name] = usage
        return usage

    def acquire(self, tenant: Tenant, work: RequestWork) -> TenantLease:
        """Admit one request's sequences or raise a 400 / 429 (Retry-After). Needs no tokens."""
        now = self._clock()
        usage = self._usage_of(tenant, now)
        limits = tenant.limits
        cap = limits.max_concurrent_requests
        if cap is not None:
            if work.num_sequences > cap:
                raise never_fits(
                    f"This request runs {work.describe_sequences()}, over this key's limit of "
                    f"{cap} concurrent sequences (max_concurrent_requests counts prompts x n).",
                    param="n" if work.n > 1 else "prompt",
                )
            if usage.in_flight + work.num_sequences > cap:
                raise rate_limited(
                    f"Too many concurrent sequences for this key: {usage.in_flight} running, this "
                    f"request needs {work.num_sequences} (limit {cap}, max_concurrent_requests "
                    f"counts prompts x n).",
                    retry_after=1,
                )
        if usage.requests is not None:
            usage.requests.refill(now)
            if usage.requests.level < 1:
                raise rate_limited(
                    f"Rate limit of {limits.requests_per_minute} requests per minute reached.",
                    retry_after=usage.requests.seconds_until(1),
                )
            usage.requests.level -= 1
        if usage.tokens is not None:
            usage.tokens.refill(now)
            if usage.tokens.level < 1:  # not even a one-token request could start
                raise rate_limited(
                    f"Token quota of {limits.tokens_per_minute} tokens per minute reached.",
                    retry_after=usage.tokens.seconds_until(1),
                )
        usage.in_flight += work.num_sequences
        return TenantLease(self, tenant, work.num_sequences)

    def _reserve_tokens(self, lease: TenantLease, work: RequestWork) -> None:
        limits = lease.tenant.limits
        usage = self._usage_of(lease.tenant, self._clock())
        if usage.tokens is None or lease.reserved_tokens:
            return
        amount = work.estimated_tokens
        if amount > usage.tokens.capacity:  # the bucket holds limits.tokens_per_minute
            raise never_fits(
                f"This request may use {work.describe_tokens()}, over this key's quota of "
                f"{limits.tokens_per_minute} tokens per minute. Lower max_tokens or n.",
                param="max_tokens",
            )
        usage.tokens.refill(self._clock())
        if usage.tokens.level < amount:
            raise rate_limited(
                f"Token quota of {limits.tokens_per_minute} tokens per minute: "
                f"{max(0, int(usage.tokens.level))} left now, this request may use "
                f"{work.describe_tokens()}.",
                retry_after=usage.tokens.seconds_until(amount),
            )
        usage.tokens.level -= amount
        lease.reserved_tokens = amount

    def _release(self, lease: TenantLease, used_tokens: int) -> None:
        usage = self._usage_of(lease.tenant, self._clock())
        usage.in_flight -= lease.num_sequences
        if usage.tokens is not None and lease.reserved_tokens:
            usage.tokens.refill(self._clock())
            usage.tokens.level = min(usage.tokens.capacity, usage.tokens.level + lease.reserved_tokens - used_tokens)

    def in_flight(self, tenant: Tenant) -> int:
        """Sequences the tenant's admitted requests hold."""
        usage = self._usage.get(tenant.name)
        return usage.in_flight if usage else 0
