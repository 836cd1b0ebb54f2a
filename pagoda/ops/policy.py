"""Release policy: thresholds on the gate's metrics; the gate passes when every rule holds.

A policy file (YAML or JSON)::

    rules:
      outputs.exact_match_rate: {min: 0.98}
      latency.itl_p99_ratio: {max: 1.10}     # widened by the measured noise band
      contract.new_failures: {max: 0}        # candidate failures the baseline lacks
      tokenization.chat_mismatches: {max: 0, required: true}

A rule on a metric the run could not measure (no /tokenize, no schemas in the suite, latency
skipped) is reported as skipped and does not fail the gate unless it says `required: true`.
Ratio rules on latency metrics compare against the threshold widened by that metric's noise
band (the relative range of the baseline's repeated runs), so measurement noise alone
rarely fails a release and a real regression larger than the noise still does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_RULES: dict[str, dict[str, Any]] = {
    "tokenization.prompt_mismatches": {"max": 0},
    "tokenization.chat_mismatches": {"max": 0},
    "outputs.exact_match_rate": {"min": 0.98},
    "outputs.logprob_drift_max": {"max": 0.05},
    "outputs.stop_reason_changes": {"max": 0},
    "outputs.refusal_changes": {"max": 0},
    "structured.validity_drop": {"max": 0.0},
    "contract.new_failures": {"max": 0},
    "contract.status_diffs": {"max": 0},
    "latency.ttft_p99_ratio": {"max": 1.25},
    "latency.itl_p99_ratio": {"max": 1.10},
    "latency.throughput_ratio": {"min": 0.90},
}


class PolicyError(ValueError):
    """A malformed policy file; the message names the rule."""


@dataclass
class Rule:
    metric: str
    min: float | None = None
    max: float | None = None
    required: bool = False

    def describe(self) -> str:
        parts = []
        if self.min is not None:
            parts.append(f">= {self.min:g}")
        if self.max is not None:
            parts.append(f"<= {self.max:g}")
        return " and ".join(parts)


@dataclass
class RuleResult:
    rule: Rule
    status: str  # pass | fail | skipped
    value: float | None
    threshold: str
    evidence: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.rule.metric,
            "status": self.status,
            "value": self.value,
            "threshold": self.threshold,
            "required": self.rule.required,
            "evidence": self.evidence,
        }


def parse_policy(data: Any, name: str = "policy") -> list[Rule]:
    if not isinstance(data, dict) or not isinstance(data.get("rules"), dict):
        raise PolicyError(f"{name}: a policy is a mapping with a `rules` mapping of metric -> {{min, max, required}}")
    rules = []
    for metric, spec in data["rules"].items():
        if (
            not isinstance(spec, dict)
            or not set(spec) <= {"min", "max", "required"}
            or ("min" not in spec and "max" not in spec)
        ):
            raise PolicyError(f"{name}: rule {metric!r} needs min and/or max (and optionally required), got {{spec!r}}")
        for bound in ("min", "max"):
            if bound in spec and not isinstance(spec[bound], (int, float)):
                raise PolicyError(f"{name}: rule {metric!r}: {bound} must be a number")
        rules.append(Rule(str(metric), spec.get("min"), spec.get("max"), bool(spec.get("required", False))))
    return rules


def load_policy(path: str | Path | None) -> list[Rule]:
    if path is None:
        return parse_policy({"rules": DEFAULT_RULES}, "default policy")
    import yaml  # YAML is a superset of JSON

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise PolicyError(f"cannot read policy {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{path}: not valid YAML ({exc})") from None
    return parse_policy(data, str(path))


def evaluate(
    rules: list[Rule], metrics: dict[str, float | None], evidence: dict[str, list[str]], noise: dict[str, float]
) -> list[RuleResult]:
    """Each rule against the run's metrics. `noise` widens ratio rules (metric -> band)."""
    results = []
    for rule in rules:
        if rule.metric not in metrics and not rule.metric.startswith("latency."):
            known = ", ".join(sorted(metrics))
            raise PolicyError(f"unknown metric {rule.metric!r} in the policy; known: {known}")
        value = metrics.get(rule.metric)
        band = noise.get(rule.metric, 0.0)
        threshold = rule.describe() + (f" (± noise {band:.3f})" if band else "")
        if value is None:
            status = "fail" if rule.required else "skipped"
            results.append(
                RuleResult(rule, status, None, threshold, evidence.get(rule.metric) or ["not measured in this run"])
            )
            continue
        ok = (rule.min is None or value >= rule.min - band) and (rule.max is None or value <= rule.max + band)
        results.append(RuleResult(rule, "pass" if ok else "fail", value, threshold, evidence.get(rule.metric, [])))
    return results
