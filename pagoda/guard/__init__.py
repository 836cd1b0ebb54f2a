"""Guardrails: input and output checks around the model (regex, blocklist, PII and a
classifier guard model), configured per tenant from a YAML file (--guardrails)."""

from pagoda.guard.classifier import GuardModel, GuardModelError, Verdict
from pagoda.guard.config import GuardrailsConfig, GuardrailsConfigError, load_guardrails, parse_guardrails
from pagoda.guard.decision import Decision, RuleHit
from pagoda.guard.guardrails import Guardrails, InputGuard, OutputFilter
from pagoda.guard.metrics import GuardMetrics

__all__ = [
    "Decision",
    "GuardMetrics",
    "GuardModel",
    "GuardModelError",
    "Guardrails",
    "GuardrailsConfig",
    "GuardrailsConfigError",
    "InputGuard",
    "OutputFilter",
    "RuleHit",
    "Verdict",
    "load_guardrails",
    "parse_guardrails",
]
