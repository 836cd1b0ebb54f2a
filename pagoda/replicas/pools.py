"""Request-shape pools: replicas tagged by pool (`--replica-pools chat=2,long=1`) and the rules
that send a request to a pool (`--route-rules FILE`), so long-context traffic does not sit in
front of chat.

A rules file (YAML or JSON):

    default: chat              # pool of requests no rule matches (default: every replica)
    rules:                     # first match wins; every condition given must hold
      - pool: long
        min_prompt_tokens: 2048
      - pool: batch
        tenants: [nightly-jobs]
        models: [pagoda-coder]
        max_prompt_tokens: 100000

The router's policy then chooses inside the pool. A pool whose replicas are all dead falls
back to every live replica (serving late beats failing).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.replicas.policies import RouteRequest

_POOL_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_replica_pools(spec: str) -> list[str]:
    """'chat=2,long=1' -> each replica's pool, in replica order: ['chat', 'chat', 'long']."""
    pools: list[str] = []
    seen: set[str] = set()
    for part in spec.split(","):
        name, sep, count = part.strip().partition("=")
        name = name.strip()
        if not sep or not _POOL_NAME.match(name) or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"replica_pools must look like chat=2,long=1 (name=count, count >= 1), got {spec!r}")
        if name in seen:
            raise ValueError(f"replica_pools names pool {name!r} twice")
        seen.add(name)
        pools.extend([name] * int(count))
    return pools


@dataclass(frozen=True)
class RouteRule:
    pool: str
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    tenants: frozenset[str] | None = None
    models: frozenset[str] | None = None

    def matches(self, request: RouteRequest) -> bool:
        length = len(request.prompt_token_ids)
        return (
            (self.min_prompt_tokens is None or length >= self.min_prompt_tokens)
            and (self.max_prompt_tokens is None or length <= self.max_prompt_tokens)
            and (self.tenants is None or request.tenant in self.tenants)
            and (self.models is None or request.model in self.models)
        )


_RULE_KEYS = {"pool", "min_prompt_tokens", "max_prompt_tokens", "tenants", "models"}


@dataclass(frozen=True)
class RouteRules:
    rules: tuple[RouteRule, ...] = ()
    default: str | None = None  # None: every replica

    def pool_of(self, request: RouteRequest) -> str | None:
        """The pool this request goes to; None for any replica."""
        for rule in self.rules:
            if rule.matches(request):
                return rule.pool
        return self.default

    def check_pools(self, pools: set[str]) -> None:
        """Every pool a rule names must exist."""
        named = {rule.pool for rule in self.rules} | ({self.default} if self.default else set())
        unknown = sorted(named - pools)
        if unknown:
            raise ValueError(
                f"route rules name pools that no replica is in: {', '.join(unknown)} "
                f"(replica pools: {', '.join(sorted(pools)) or 'none'})"
            )

    @classmethod
    def from_dict(cls, data: Any) -> RouteRules:
        if not isinstance(data, dict):
            raise ValueError("a route rules file is a mapping with `rules` (a list) and `default`")
        unknown = set(data) - {"rules", "default"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; expected rules and default")
        default = data.get("default")
        if default is not None and not isinstance(default, str):
            raise ValueError(f"default must be a pool name, got {default!r}")
        entries = data.get("rules") or []
        if not isinstance(entries, list):
            raise ValueError("rules must be a list")
        return cls(tuple(_rule(i, entry) for i, entry in enumerate(entries)), default)

    @classmethod
    def from_file(cls, path: str | Path) -> RouteRules:
        """Read a YAML or JSON rules file; raises OSError or ValueError (with the reason)."""
        text = Path(path).read_text()
        if str(path).endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ValueError(f"not valid YAML: {exc}") from None
        return cls.from_dict(data)


def _rule(index: int, entry: Any) -> RouteRule:
    where = f"rule {index + 1}"
    if not isinstance(entry, dict) or not isinstance(entry.get("pool"), str):
        raise ValueError(f"{where}: each rule is a mapping with a `pool` name")
    unknown = set(entry) - _RULE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(_RULE_KEYS)}")
    bounds: dict[str, int | None] = {}
    for key in ("min_prompt_tokens", "max_prompt_tokens"):
        value = entry.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{where}: {key} must be a non-negative integer, got {value!r}")
        bounds[key] = value
    names: dict[str, frozenset[str] | None] = {}
    for key in ("tenants", "models"):
        value = entry.get(key)
        if isinstance(value, str):
            value = [value]
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise ValueError(f"{where}: {key} must be a list of names, got {value!r}")
        names[key] = frozenset(value) if value is not None else None
    return RouteRule(
        entry["pool"],
        min_prompt_tokens=bounds["min_prompt_tokens"],
        max_prompt_tokens=bounds["max_prompt_tokens"],
        tenants=names["tenants"],
        models=names["models"],
    )
