"""The guardrails file (YAML or JSON), parsed into rules. Anything malformed raises
GuardrailsConfigError naming the rule (or model) and what is wrong with it::

    fail_mode: closed            # classifier failure: closed = treat as blocked, open = allow
    output_hold_chars: 64        # pattern rules: most streamed text held back for a match
    classifier_window_chars: 256 # classifier rules: output checked in windows this long
    models:
      guard:
        path: /models/llama-guard-3-1b
        template: "..."          # optional; {role} and {text}; default Llama Guard's framing
        chat_template: true      # wrap the template in the model's chat template
        safe_label: safe
        unsafe_label: unsafe
        max_tokens: 10
        max_batch: 16            # concurrent checks labelled in one engine call
        engine: {num_kv_blocks: 512}   # any EngineConfig field
    rules:
      - {name: no-pii, kind: pii, types: [email, phone, credit_card, api_key], action: redact}
      - {name: words, kind: blocklist, words: [foo, bar], action: block, stages: [input]}
      - {name: tickets, kind: regex, pattern: 'TICKET-\\d+', action: flag, tenants: [acme]}
      - {name: safety, kind: classifier, model: guard, action: block}

`stages` defaults to both input and output; `tenants` to every tenant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex

from pagoda.data_files import DataFileError, read_data_file
from pagoda.guard.classifier import GuardModel
from pagoda.guard.decision import ACTIONS, STAGES
from pagoda.guard.pii import PII_TYPES
from pagoda.guard.rules import ClassifierRule, PatternRule, Rule, blocklist_pattern

RULE_KINDS = ("regex", "blocklist", "pii", "classifier")
FAIL_MODES = ("open", "closed")


class GuardrailsConfigError(ValueError):
    """The guardrails file is malformed; the message names the rule."""


@dataclass
class GuardrailsConfig:
    rules: list[Rule]
    models: dict[str, GuardModel]
    fail_mode: str = "closed"
    output_hold_chars: int = 64
    classifier_window_chars: int = 256
    source: str = field(default="<config>")


_COMMON_KEYS = {"name", "kind", "action", "stages", "tenants"}
_KIND_KEYS = {
    "regex": {"pattern", "case_sensitive", "replacement"},
    "blocklist": {"words", "case_sensitive", "replacement"},
    "pii": {"types", "replacement"},
    "classifier": {"model"},
}
_MODEL_KEYS = {"path", "template", "chat_template", "safe_label", "unsafe_label", "max_tokens", "max_batch", "engine"}


def _positive_int(data: dict[str, Any], key: str, default: int) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GuardrailsConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _string_list(where: str, key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise GuardrailsConfigError(f"{where}: {key} must be a non-empty list of strings, got {value!r}")
    return value


def _parse_model(name: str, spec: Any) -> GuardModel:
    where = f"model {name!r}"
    if not isinstance(spec, dict):
        raise GuardrailsConfigError(f"{where}: must be a mapping with a path")
    unknown = set(spec) - _MODEL_KEYS
    if unknown:
        raise GuardrailsConfigError(
            f"{where}: unknown settings {sorted(unknown)}; known: {', '.join(sorted(_MODEL_KEYS))}"
        )
    path = spec.get("path")
    if not isinstance(path, str) or not path:
        raise GuardrailsConfigError(f"{where}: path (a local model directory) is required")
    if not (Path(path) / "config.json").is_file():
        raise GuardrailsConfigError(f"{where}: no model at {path} (config.json not found)")
    model = GuardModel(name=name, path=path)
    if "template" in spec:
        template = spec["template"]
        if not isinstance(template, str) or "{text}" not in template:
            raise GuardrailsConfigError(f"{where}: template must be a string containing {{text}}")
        try:
            template.format(role="User", text="")
        except (KeyError, IndexError, ValueError) as exc:
            raise GuardrailsConfigError(
                f"{where}: template has a bad placeholder ({exc}); use {{role}} and {{text}}, and {{{{ }}}} for braces"
            ) from None
        model.template = template
    for key, attr in (("safe_label", "safe_label"), ("unsafe_label", "unsafe_label")):
        if key in spec:
            if not isinstance(spec[key], str) or not spec[key].strip():
                raise GuardrailsConfigError(f"{where}: {key} must be a non-empty string")
            setattr(model, attr, spec[key].strip())
    if model.safe_label.lower() == model.unsafe_label.lower():
        raise GuardrailsConfigError(f"{where}: safe_label and unsafe_label must differ")
    model.use_chat_template = bool(spec.get("chat_template", True))
    try:
        model.max_tokens = _positive_int(spec, "max_tokens", model.max_tokens)
        model.max_batch = _positive_int(spec, "max_batch", model.max_batch)
    except GuardrailsConfigError as exc:
        raise GuardrailsConfigError(f"{where}: {exc}") from None
    engine = spec.get("engine", {})
    if not isinstance(engine, dict):
        raise GuardrailsConfigError(f"{where}: engine must be a mapping of EngineConfig fields")
    model.engine_args = dict(engine)
    return model


def _parse_rule(index: int, spec: Any, models: dict[str, GuardModel]) -> Rule:
    if not isinstance(spec, dict):
        raise GuardrailsConfigError(f"rules[{index}]: must be a mapping, got {spec!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise GuardrailsConfigError(f"rules[{index}]: every rule needs a name")
    where = f"rule {name!r}"
    kind = spec.get("kind")
    if kind not in RULE_KINDS:
        raise GuardrailsConfigError(f"{where}: unknown kind {kind!r}; use one of {', '.join(RULE_KINDS)}")
    unknown = set(spec) - _COMMON_KEYS - _KIND_KEYS[kind]
    if unknown:
        raise GuardrailsConfigError(
            f"{where}: unknown settings {sorted(unknown)} for a {kind} "
            f"rule; known: {', '.join(sorted(_COMMON_KEYS | _KIND_KEYS[kind]))}"
        )
    action = spec.get("action")
    allowed = ("block", "flag") if kind == "classifier" else ACTIONS
    if action not in allowed:
        raise GuardrailsConfigError(f"{where}: action must be one of {', '.join(allowed)}, got {action!r}")
    stages = _string_list(where, "stages", spec.get("stages", list(STAGES)))
    bad_stages = set(stages) - set(STAGES)
    if bad_stages:
        raise GuardrailsConfigError(f"{where}: unknown stages {sorted(bad_stages)}; use input, output")
    tenants = spec.get("tenants")
    tenant_set = frozenset(_string_list(where, "tenants", tenants)) if tenants is not None else None
    common = dict(name=name, kind=kind, action=action, stages=frozenset(stages), tenants=tenant_set)
    replacement = spec.get("replacement")
    if replacement is not None and not isinstance(replacement, str):
        raise GuardrailsConfigError(f"{where}: replacement must be a string")
    case_sensitive = bool(spec.get("case_sensitive", False))
    if kind == "regex":
        pattern = spec.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise GuardrailsConfigError(f"{where}: pattern (a regular expression) is required")
        try:
            compiled = regex.compile(pattern, 0 if case_sensitive else regex.IGNORECASE)
        except regex.error as exc:
            raise GuardrailsConfigError(f"{where}: bad regex {pattern!r}: {exc}") from None
        if compiled.fullmatch(""):
            raise GuardrailsConfigError(f"{where}: the regex matches the empty string")
        return PatternRule(**common, pattern=compiled, replacement=replacement)
    if kind == "blocklist":
        words = _string_list(where, "words", spec.get("words"))
        return PatternRule(**common, pattern=blocklist_pattern(words, case_sensitive), replacement=replacement)
    if kind == "pii":
        types = _string_list(where, "types", spec.get("types", list(PII_TYPES)))
        bad_types = set(types) - set(PII_TYPES)
        if bad_types:
            raise GuardrailsConfigError(f"{where}: unknown pii types {sorted(bad_types)}; use {', '.join(PII_TYPES)}")
        return PatternRule(**common, pii_types=tuple(types), replacement=replacement)
    model_name = spec.get("model")
    if model_name not in models:
        raise GuardrailsConfigError(
            f"{where}: model {model_name!r} is not defined under "
            f"models (defined: {', '.join(sorted(models)) or 'none'})"
        )
    return ClassifierRule(**common, model=models[model_name])


def parse_guardrails(data: Any, source: str = "<config>") -> GuardrailsConfig:
    """The file's content -> rules and guard models (not loaded yet)."""
    if not isinstance(data, dict):
        raise GuardrailsConfigError("the guardrails file must be a mapping with a `rules` list")
    known = {"rules", "models", "fail_mode", "output_hold_chars", "classifier_window_chars"}
    unknown = set(data) - known
    if unknown:
        raise GuardrailsConfigError(f"unknown settings {sorted(unknown)}; known: {', '.join(sorted(known))}")
    fail_mode = data.get("fail_mode", "closed")
    if fail_mode not in FAIL_MODES:
        raise GuardrailsConfigError(f"fail_mode must be open or closed, got {fail_mode!r}")
    models_spec = data.get("models") or {}
    if not isinstance(models_spec, dict):
        raise GuardrailsConfigError("models must be a mapping of name -> settings")
    rules_spec = data.get("rules")
    models = {}
    for name, spec in models_spec.items():
        try:
            models[str(name)] = _parse_model(str(name), spec)
        except GuardrailsConfigError as exc:
            raise GuardrailsConfigError(_for_rules(rules_spec, str(name)) + str(exc)) from None
    if not isinstance(rules_spec, list) or not rules_spec:
        raise GuardrailsConfigError("rules must be a non-empty list")
    rules = [_parse_rule(i, spec, models) for i, spec in enumerate(rules_spec)]
    names = [r.name for r in rules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise GuardrailsConfigError(f"rule names must be unique; repeated: {duplicates}")
    used = {r.model.name for r in rules if isinstance(r, ClassifierRule) and r.model}
    return GuardrailsConfig(
        rules=rules,
        models={n: m for n, m in models.items() if n in used},
        fail_mode=fail_mode,
        output_hold_chars=_positive_int(data, "output_hold_chars", 64),
        classifier_window_chars=_positive_int(data, "classifier_window_chars", 256),
        source=source,
    )


def _for_rules(rules_spec: Any, model_name: str) -> str:
    """'rule 'a', 'b': ' for the rules that use `model_name`, so its errors name them."""
    names = [
        str(r.get("name"))
        for r in (rules_spec if isinstance(rules_spec, list) else [])
        if isinstance(r, dict) and r.get("model") == model_name
    ]
    return f"rule {', '.join(repr(n) for n in names)}: " if names else ""


def load_guardrails(path: str | Path) -> GuardrailsConfig:
    """Read, validate and load (guard models included) a guardrails file."""
    try:
        data = read_data_file(path)
    except DataFileError as exc:
        raise GuardrailsConfigError(f"{path}: {exc}") from None
    config = parse_guardrails(data, str(path))
    for model in config.models.values():
        try:
            model.load()
        except Exception as exc:
            raise GuardrailsConfigError(
                _for_rules(data.get("rules"), model.name) + f"model {model.name!r} "
                f"({model.path}) could not be loaded: {exc}"
            ) from None
    return config
