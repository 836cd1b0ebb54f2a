"""The models file of `pagoda serve --models FILE`: several base models behind one server, the
routes that pick one of them for a request, and each model's fallbacks.

    models:
      - name: small
        model: /models/qwen-0.5b          # a path, a bundled model's name or a GGUF file
        aliases: [fast]
        data_parallel_size: 2             # any EngineConfig / DeploymentConfig field by its name
        max_model_len: 4096
        fallbacks:
          - model: large                  # another model of this file
          - url: http://other-host:8000/v1  # a remote OpenAI-compatible endpoint
            model: qwen-7b
            api_key_env: OTHER_KEY        # the key is read from this environment variable
            connect_timeout: 2            # seconds; a remote that is down is skipped
            first_byte_timeout: 30
      - name: large
        model: /models/qwen-7b
    routes:
      - name: auto                        # a request with "model": "auto" is routed
        rules:                            # first match wins; a rule without conditions always matches
          - {tenant: [acme], model: large}
          - {task: summarize, max_prompt_tokens: 2000, model: small}
          - {class: cheap, model: small}  # metadata.class or the x-pagoda-class header
          - {model: large}
    canary:                               # a share of `stable`'s traffic goes to `candidate`
      stable: large
      candidate: large-v2                 # another model of this file, kept loaded throughout
      weight: 0.1                         # the share of eligible requests (0..1)
      tenants: [acme]                     # optional: only these tenants' requests are eligible
      routes: [auto]                      # optional: only requests naming these routes or names
      window_s: 60                        # the live windows compared
      min_requests: 20                    # per side, before the live rules judge
      promote_after_s: 3600               # optional: promote after this long without a broken rule
      shadow: {sample: 0.05, max_tokens: 16}  # stable requests replayed greedily to both
      rules: {error_rate: 0.02, ttft_p99_ratio: 1.5, tokenization_mismatches: 0}

The command line's engine and deployment flags are every model's defaults; an entry overrides
them for its model. Every mistake (an unknown key, a duplicate name or alias, a route or
fallback naming a model that is not here, a fallback cycle, a bad engine option, a canary of
unknown models, a weight outside 0..1 or an unknown rule name) is a
`ModelsFileError` that names the file and line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.config import DeploymentConfig, EngineConfig

ENGINE_KEYS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
DEPLOYMENT_KEYS = frozenset(f.name for f in dataclasses.fields(DeploymentConfig))
MODEL_KEYS = frozenset({"name", "aliases", "fallbacks"}) | ENGINE_KEYS | DEPLOYMENT_KEYS
LOCAL_FALLBACK_KEYS = frozenset({"model"})
REMOTE_FALLBACK_KEYS = frozenset({"url", "model", "api_key_env", "connect_timeout", "first_byte_timeout"})
ROUTE_KEYS = frozenset({"name", "rules"})
RULE_KEYS = frozenset({"model", "tenant", "task", "class", "min_prompt_tokens", "max_prompt_tokens"})
CANARY_KEYS = frozenset(
    {
        "stable",
        "candidate",
        "weight",
        "tenants",
        "routes",
        "seed",
        "window_s",
        "min_requests",
        "promote_after_s",
        "shadow",
        "rules",
    }
)
SHADOW_KEYS = frozenset({"sample", "max_tokens"})
# A canary's rules: what each threshold bounds (candidate against stable over the live windows,
# or over the shadow replays of the window), and the thresholds used when `rules` is not given.
CANARY_RULES = {
    "error_rate": "candidate's 5xx rate minus stable's, at most",
    "ttft_p99_ratio": "candidate's p99 time to first token over stable's, at most",
    "itl_p99_ratio": "candidate's p99 inter-token latency over stable's, at most",
    "guardrail_block_rate": "candidate's guardrail block rate minus stable's, at most",
    "tokenization_mismatches": "shadow replays whose prompt or chat template tokenizes differently, at most",
    "output_mismatch_rate": "share of shadow replays whose greedy output differs, at most",
    "stop_reason_changes": "shadow replays whose finish reason differs, at most",
    "refusal_changes": "shadow replays that refuse on one side only, at most",
    "logprob_drift_max": "largest logprob difference along shared greedy tokens, at most",
}
DEFAULT_CANARY_RULES = {
    "error_rate": 0.05,
    "ttft_p99_ratio": 2.0,
    "itl_p99_ratio": 2.0,
    "guardrail_block_rate": 0.05,
    "tokenization_mismatches": 0.0,
}
TOP_KEYS = frozenset({"models", "routes", "canary"})

DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_FIRST_BYTE_TIMEOUT_S = 30.0


class ModelsFileError(ValueError):
    """A mistake in the models file, its message starting with FILE:LINE."""


@dataclass(frozen=True)
class RemoteEndpoint:
    """An OpenAI-compatible server elsewhere that answers for `model`."""

    url: str  # its base URL, up to and including /v1
    model: str
    api_key_env: str | None = None  # the environment variable holding its key
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT_S

    @property
    def label(self) -> str:
        return f"{self.model}@{self.url}"


@dataclass(frozen=True)
class FallbackTarget:
    """One entry of a model's `fallbacks`: a model of this file, or a remote endpoint."""

    model: str | None = None
    remote: RemoteEndpoint | None = None

    @property
    def label(self) -> str:
        if self.remote is not None:
            return self.remote.label
        assert self.model is not None, "a fallback names a model of this file or a remote endpoint"
        return self.model


@dataclass(frozen=True)
class ModelEntry:
    name: str
    model: str
    line: int
    aliases: tuple[str, ...] = ()
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields it sets
    deployment: dict[str, Any] = field(default_factory=dict)  # DeploymentConfig fields it sets
    fallbacks: tuple[FallbackTarget, ...] = ()

    def engine_config(self, defaults: EngineConfig, models: int = 1) -> EngineConfig:
        """This model's engine settings over `defaults`. Under --kv-cache-memory auto the `models`
        of one file share the free memory: each takes its part of the share, unless it sets its own."""
        config = dataclasses.replace(defaults, model=self.model, **self.engine)
        if models > 1 and config.kv_cache_memory == "auto" and "kv_cache_memory_share" not in self.engine:
            config = dataclasses.replace(config, kv_cache_memory_share=config.kv_cache_memory_share / models)
        return config

    def deployment_config(self, defaults: DeploymentConfig) -> DeploymentConfig:
        return dataclasses.replace(defaults, **self.deployment)


@dataclass(frozen=True)
class RouteRule:
    """Sends a request to `model` when every condition it sets holds."""

    model: str
    line: int
    tenants: frozenset[str] | None = None
    tasks: frozenset[str] | None = None
    classes: frozenset[str] | None = None
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class Route:
    name: str
    rules: tuple[RouteRule, ...]
    line: int


@dataclass(frozen=True)
class ShadowSpec:
    """Stable requests replayed greedily to stable and candidate and diffed (serve/observability/drift.py)."""

    sample: float = 0.0  # the share of stable's requests replayed (0: no shadow traffic)
    max_tokens: int = 16


@dataclass(frozen=True)
class CanarySpec:
    """The `canary` block: who gets the candidate, and when it is rolled back or promoted."""

    stable: str
    candidate: str
    line: int = 0
    weight: float = 1.0
    tenants: frozenset[str] | None = None
    routes: frozenset[str] | None = None  # request `model` values (routes or names) eligible
    seed: int | None = None  # of the chooser: a seeded split is reproducible
    window_s: float = 60.0
    min_requests: int = 20
    promote_after_s: float | None = None
    shadow: ShadowSpec = ShadowSpec()
    rules: tuple[tuple[str, float], ...] = tuple(DEFAULT_CANARY_RULES.items())


@dataclass(frozen=True)
class ModelsFile:
    path: str
    models: tuple[ModelEntry, ...]
    routes: tuple[Route, ...] = ()
    canary: CanarySpec | None = None


# ---- reading YAML with line numbers ------------------------------------------------------------


@dataclass(frozen=True)
class _Node:
    """A YAML value with the (1-based) line it starts on."""

    value: Any  # dict[str, _Node], list[_Node] or a scalar
    line: int


def _plain(node: _Node) -> Any:
    if isinstance(node.value, dict):
        return {k: _plain(v) for k, v in node.value.items()}
    if isinstance(node.value, list):
        return [_plain(v) for v in node.value]
    return node.value


def _compose(text: str, fail: Callable[[int, str], Exception]) -> _Node:
    import yaml

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise fail(mark.line + 1 if mark else 1, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if root is None:
        raise fail(1, "the file is empty")
    constructor = yaml.SafeLoader("")

    def convert(node: Any) -> _Node:
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            mapping: dict[str, _Node] = {}
            for key_node, value_node in node.value:
                key = constructor.construct_object(key_node)
                if not isinstance(key, str):
                    raise fail(key_node.start_mark.line + 1, f"keys must be strings, got {key!r}")
                if key in mapping:
                    raise fail(key_node.start_mark.line + 1, f"{key!r} is set twice")
                mapping[key] = convert(value_node)
            return _Node(mapping, line)
        if isinstance(node, yaml.SequenceNode):
            return _Node([convert(item) for item in node.value], line)
        return _Node(constructor.construct_object(node), line)

    return convert(root)


# ---- the file --------------------------------------------------------------------------------


class _Reader:
    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, line: int, message: str) -> ModelsFileError:
        return ModelsFileError(f"{self.path}:{line}: {message}")

    def mapping(self, node: _Node, what: str, known: frozenset[str]) -> dict[str, _Node]:
        if not isinstance(node.value, dict):
            raise self.error(node.line, f"{what} must be a mapping")
        for key, value in node.value.items():
            if key not in known:
                raise self.error(value.line, f"{what}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        return node.value

    def sequence(self, node: _Node, what: str) -> list[_Node]:
        if not isinstance(node.value, list):
            raise self.error(node.line, f"{what} must be a list")
        return node.value

    def text(self, node: _Node, what: str) -> str:
        if not isinstance(node.value, str) or not node.value.strip():
            raise self.error(node.line, f"{what} must be a non-empty string, got {node.value!r}")
        return node.value.strip()

    def names(self, node: _Node, what: str) -> frozenset[str]:
        """One name or a list of names."""
        items = node.value if isinstance(node.value, list) else [node]
        return frozenset(self.text(item, what) for item in items)

    def count(self, node: _Node, what: str) -> int:
        if not isinstance(node.value, int) or isinstance(node.value, bool) or node.value < 0:
            raise self.error(node.line, f"{what} must be a non-negative integer, got {node.value!r}")
        return node.value

    def seconds(self, node: _Node, what: str) -> float:
        if not isinstance(node.value, (int, float)) or isinstance(node.value, bool) or node.value <= 0:
            raise self.error(node.line, f"{what} must be a positive number of seconds, got {node.value!r}")
        return float(node.value)


def parse_models_file(text: str, path: str = "models file") -> ModelsFile:
    """The models file's content -> ModelsFile; ModelsFileError naming the line otherwise."""
    reader = _Reader(path)
    root = reader.mapping(_compose(text, reader.error), "the models file", TOP_KEYS)
    if "models" not in root:
        raise reader.error(1, "the models file needs a `models` list")
    models = tuple(_model_entry(reader, node) for node in reader.sequence(root["models"], "models"))
    if not models:
        raise reader.error(root["models"].line, "`models` lists no model")
    routes = (
        tuple(_route(reader, node) for node in reader.sequence(root["routes"], "routes")) if "routes" in root else ()
    )
    _check_names(reader, models, routes)
    canary = _canary(reader, root["canary"], models, routes) if "canary" in root else None
    return ModelsFile(path, models, routes, canary)


def load_models_file(path: str | Path) -> ModelsFile:
    """Read and check a models file (OSError if it cannot be read)."""
    return parse_models_file(Path(path).read_text(), str(path))


def _model_entry(reader: _Reader, node: _Node) -> ModelEntry:
    fields = reader.mapping(node, "a model", MODEL_KEYS)
    for required in ("name", "model"):
        if required not in fields:
            raise reader.error(node.line, f"a model needs `{required}`")
    name = reader.text(fields["name"], "name")
    aliases = (
        tuple(reader.text(a, "an alias") for a in reader.sequence(fields["aliases"], "aliases"))
        if "aliases" in fields
        else ()
    )
    fallbacks = (
        tuple(_fallback(reader, f) for f in reader.sequence(fields["fallbacks"], "fallbacks"))
        if "fallbacks" in fields
        else ()
    )
    engine = {k: _plain(v) for k, v in fields.items() if k in ENGINE_KEYS and k != "model"}
    deployment = {k: _plain(v) for k, v in fields.items() if k in DEPLOYMENT_KEYS}
    entry = ModelEntry(name, reader.text(fields["model"], "model"), node.line, aliases, engine, deployment, fallbacks)
    # The engine options are checked now, against the defaults, so a bad one names its line.
    for key in (*engine, *deployment):
        try:
            if key in engine:
                dataclasses.replace(EngineConfig(model=entry.model), **{key: engine[key]})
            else:
                dataclasses.replace(DeploymentConfig(), **{key: deployment[key]})
        except (ValueError, TypeError, SystemExit) as exc:
            raise reader.error(fields[key].line, f"model {name!r}: {key}: {exc}") from None
    return entry


def _fallback(reader: _Reader, node: _Node) -> FallbackTarget:
    if isinstance(node.value, str):  # a bare name: a model of this file
        return FallbackTarget(model=reader.text(node, "a fallback"))
    fields = reader.mapping(node, "a fallback", REMOTE_FALLBACK_KEYS)
    if "model" not in fields:
        raise reader.error(node.line, "a fallback needs `model`")
    model = reader.text(fields["model"], "a fallback's model")
    if "url" not in fields:
        extra = set(fields) - LOCAL_FALLBACK_KEYS
        if extra:
            raise reader.error(node.line, f"{', '.join(sorted(extra))} need `url` (a remote endpoint)")
        return FallbackTarget(model=model)
    url = reader.text(fields["url"], "url").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise reader.error(fields["url"].line, f"url must start with http:// or https://, got {url!r}")
    return FallbackTarget(
        remote=RemoteEndpoint(
            url,
            model,
            api_key_env=reader.text(fields["api_key_env"], "api_key_env") if "api_key_env" in fields else None,
            connect_timeout=reader.seconds(fields["connect_timeout"], "connect_timeout")
            if "connect_timeout" in fields
            else DEFAULT_CONNECT_TIMEOUT_S,
            first_byte_timeout=reader.seconds(fields["first_byte_timeout"], "first_byte_timeout")
            if "first_byte_timeout" in fields
            else DEFAULT_FIRST_BYTE_TIMEOUT_S,
        )
    )


def _route(reader: _Reader, node: _Node) -> Route:
    fields = reader.mapping(node, "a route", ROUTE_KEYS)
    if "name" not in fields or "rules" not in fields:
        raise reader.error(node.line, "a route needs `name` and `rules`")
    rules = tuple(_rule(reader, r) for r in reader.sequence(fields["rules"], "rules"))
    if not rules:
        raise reader.error(fields["rules"].line, "a route needs at least one rule")
    return Route(reader.text(fields["name"], "a route's name"), rules, node.line)


def _rule(reader: _Reader, node: _Node) -> RouteRule:
    fields = reader.mapping(node, "a rule", RULE_KEYS)
    if "model" not in fields:
        raise reader.error(node.line, "a rule needs `model` (where it sends requests)")
    optional: dict[str, Any] = {}
    for key, target in (("tenant", "tenants"), ("task", "tasks"), ("class", "classes")):
        if key in fields:
            optional[target] = reader.names(fields[key], key)
    for key in ("min_prompt_tokens", "max_prompt_tokens"):
        if key in fields:
            optional[key] = reader.count(fields[key], key)
    return RouteRule(reader.text(fields["model"], "a rule's model"), node.line, **optional)


def _fraction(reader: _Reader, node: _Node, what: str) -> float:
    if not isinstance(node.value, (int, float)) or isinstance(node.value, bool) or not 0 <= node.value <= 1:
        raise reader.error(node.line, f"{what} must be a number from 0 to 1, got {node.value!r}")
    return float(node.value)


def _canary(reader: _Reader, node: _Node, models: tuple[ModelEntry, ...], routes: tuple[Route, ...]) -> CanarySpec:
    fields = reader.mapping(node, "the canary", CANARY_KEYS)
    owner = {name: entry.name for entry in models for name in (entry.name, *entry.aliases)}
    sides: dict[str, str] = {}
    for side in ("stable", "candidate"):
        if side not in fields:
            raise reader.error(node.line, f"the canary needs `{side}` (a model of this file)")
        name = reader.text(fields[side], side)
        if name not in owner:
            raise reader.error(fields[side].line, f"the canary's {side} {name!r} is not a model of this file")
        sides[side] = owner[name]
    if sides["stable"] == sides["candidate"]:
        raise reader.error(fields["candidate"].line, "the canary's candidate is its stable model")
    options: dict[str, Any] = {}
    if "weight" in fields:
        options["weight"] = _fraction(reader, fields["weight"], "weight")
    for key in ("tenants", "routes"):
        if key in fields:
            options[key] = reader.names(fields[key], key)
    for name in options.get("routes", ()):
        if name not in owner and name not in {route.name for route in routes}:
            raise reader.error(
                fields["routes"].line, f"the canary's route {name!r} is neither a route nor a model of this file"
            )
    if "seed" in fields:
        options["seed"] = reader.count(fields["seed"], "seed")
    if "min_requests" in fields:
        options["min_requests"] = reader.count(fields["min_requests"], "min_requests")
    for key in ("window_s", "promote_after_s"):
        if key in fields:
            options[key] = reader.seconds(fields[key], key)
    if "shadow" in fields:
        shadow = reader.mapping(fields["shadow"], "the canary's shadow", SHADOW_KEYS)
        options["shadow"] = ShadowSpec(
            sample=_fraction(reader, shadow["sample"], "shadow sample") if "sample" in shadow else 0.0,
            max_tokens=reader.count(shadow["max_tokens"], "shadow max_tokens") if "max_tokens" in shadow else 16,
        )
        if options["shadow"].max_tokens < 1:
            raise reader.error(shadow["max_tokens"].line, "shadow max_tokens must be at least 1")
    if "rules" in fields:
        rules = reader.mapping(fields["rules"], "the canary's rules", frozenset(CANARY_RULES))
        thresholds = []
        for name, value in rules.items():
            if not isinstance(value.value, (int, float)) or isinstance(value.value, bool) or value.value < 0:
                raise reader.error(
                    value.line, f"canary rule {name}: the threshold must be a non-negative number, got {value.value!r}"
                )
            thresholds.append((name, float(value.value)))
        options["rules"] = tuple(thresholds)
    return CanarySpec(sides["stable"], sides["candidate"], node.line, **options)


def _check_names(reader: _Reader, models: tuple[ModelEntry, ...], routes: tuple[Route, ...]) -> None:
    """One owner per name; every route and fallback names a model here; no fallback cycle."""
    owner: dict[str, str] = {}
    for entry in models:
        for name in (entry.name, *entry.aliases):
            if name in owner:
                raise reader.error(
                    entry.line, f"the name {name!r} is taken twice (models {owner[name]!r} and {entry.name!r})"
                )
            owner[name] = entry.name
    for route in routes:
        if route.name in owner:
            raise reader.error(route.line, f"the route {route.name!r} has the name of model {owner[route.name]!r}")
        owner[route.name] = f"route {route.name}"
        for rule in route.rules:
            if rule.model not in owner or owner[rule.model].startswith("route "):
                raise reader.error(
                    rule.line,
                    f"route {route.name!r} sends requests to {rule.model!r}, which is not a model of this file",
                )
    canonical = {entry.name: entry for entry in models}
    for entry in models:
        for target in entry.fallbacks:
            if target.model is not None and (target.model not in owner or owner[target.model].startswith("route ")):
                raise reader.error(
                    entry.line,
                    f"model {entry.name!r} falls back to {target.model!r}, which is not a model of this file",
                )
    for entry in models:
        _check_no_cycle(reader, entry, canonical, owner)


def _check_no_cycle(reader: _Reader, start: ModelEntry, models: dict[str, ModelEntry], owner: dict[str, str]) -> None:
    path = [start.name]

    def visit(entry: ModelEntry) -> None:
        for target in entry.fallbacks:
            if target.model is None:
                continue
            name = owner[target.model]
            if name in path:
                cycle = " -> ".join([*path[path.index(name) :], name])
                raise reader.error(start.line, f"fallback cycle: {cycle}")
            path.append(name)
            visit(models[name])
            path.pop()

    visit(start)
