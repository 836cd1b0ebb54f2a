"""`pagoda doctor URL`: /health, two /metrics scrapes a window apart and, with --probe, a few
requests of its own, judged by the shared triage rules (pagoda.diagnosis) into ranked findings.

Works against any server exporting pagoda's or vLLM's metric names; what a server does not
export, the rules skip. The exit code is the worst severity: 0 nothing above info, 1 a warning,
2 a critical finding, 3 the doctor could not read the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from pagoda.bench.server_metrics import parse_labeled
from pagoda.diagnosis import Finding, Observations, Targets, diagnose, observe, worst_severity
from pagoda.ops.doctor_probe import run_probe

EXIT_CODES = {None: 0, "info": 0, "warning": 1, "critical": 2}
EXIT_COULD_NOT_RUN = 3


class DoctorError(RuntimeError):
    """The server could not be read (unreachable, or no Prometheus /metrics)."""


@dataclass
class DoctorOptions:
    url: str  # base URL, with or without /v1
    window_s: float = 30.0
    probe: bool = False
    api_keys: list[str] = field(default_factory=list)  # the first for every request; a second for the salt probe
    model: str | None = None  # default: the first of /v1/models
    targets: Targets = field(default_factory=Targets)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"--window must be >= 0 seconds, got {self.window_s}")
        base = self.url.rstrip("/")
        self.url = base[: -len("/v1")] if base.endswith("/v1") else base
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"{self.url!r} is not an http(s) URL")


@dataclass
class DoctorReport:
    url: str
    window_s: float
    model: str | None
    health: dict[str, Any] | None
    findings: list[Finding]
    observations: Observations

    @property
    def worst(self) -> str | None:
        return worst_severity(self.findings)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.worst]

    def to_dict(self) -> dict[str, Any]:
        obs = asdict(self.observations)
        obs["histograms"] = {
            key: {"count": h.count, "mean": h.mean, "p50": h.quantile(0.5), "p95": h.quantile(0.95)}
            for key, h in self.observations.histograms.items()
            if h.count > 0
        }
        return {
            "url": self.url,
            "window_s": self.window_s,
            "model": self.model,
            "health": self.health,
            "worst_severity": self.worst,
            "exit_code": self.exit_code,
            "findings": [asdict(f) for f in self.findings],
            "observations": obs,
        }


def _get(client: httpx.Client, url: str, headers: dict[str, str]) -> httpx.Response:
    try:
        return client.get(url, headers=headers)
    except httpx.HTTPError as error:
        raise DoctorError(f"cannot reach {url}: {type(error).__name__}: {error}") from None


def _scrape(client: httpx.Client, url: str, headers: dict[str, str]) -> dict[Any, float]:
    response = _get(client, url + "/metrics", headers)
    if response.status_code != 200:
        raise DoctorError(f"GET {url}/metrics answered {response.status_code}: the doctor reads Prometheus metrics")
    return parse_labeled(response.text)


def _models(client: httpx.Client, url: str, headers: dict[str, str]) -> dict[str, Any]:
    response = _get(client, url + "/v1/models", headers)
    if response.status_code != 200:
        return {}
    data = response.json().get("data") or []
    return data[0] if data else {}


def _gate_pointer(url: str, model: str | None) -> Finding:
    """Wrong output is not in the metrics; the release gate compares outputs."""
    model_flag = f" --candidate-model {model}" if model else ""
    return Finding(
        "output_check",
        "info",
        "output correctness is not visible in metrics",
        {},
        [
            f"after an upgrade or a config change: `pagoda gate BASELINE_URL {url}{model_flag}` "
            "(greedy outputs, tokenization, chat template, API contract, latency)",
            f"or launch the old version beside it: `pagoda gate 'pagoda:--model OLD' {url}`",
        ],
    )


def run_doctor(options: DoctorOptions, *, sleep: Callable[[float], None] = time.sleep) -> DoctorReport:
    """Read the server, wait the window, read it again, probe if asked, and diagnose."""
    headers = {"Authorization": f"Bearer {options.api_keys[0]}"} if options.api_keys else {}
    with httpx.Client(timeout=options.timeout_s, trust_env=False) as client:
        response = _get(client, options.url + "/health", headers)
        health = (
            response.json()
            if response.headers.get("content-type", "").startswith("application/json")
            else {"status": "ok" if response.status_code == 200 else "dead", "http_status": response.status_code}
        )
        before = _scrape(client, options.url, headers)
        started = time.monotonic()
        sleep(options.window_s)
        after = _scrape(client, options.url, headers)
        elapsed = max(time.monotonic() - started, 1e-3)
        card = _models(client, options.url, headers) if health.get("status") != "dead" else {}
    model = options.model or card.get("id")
    probe = None
    if options.probe and model and health.get("status") != "dead":
        probe = run_probe(options.url, model, options.api_keys, timeout=options.timeout_s)
    obs = observe(
        before,
        after,
        elapsed,
        health=health,
        max_num_seqs=card.get("max_num_seqs"),
        max_model_len=card.get("max_model_len"),
        probe=probe,
    )
    findings = diagnose(obs, options.targets)
    if probe is not None and probe.errors:
        findings.insert(
            0,
            Finding(
                "probe_failed",
                "warning",
                "the doctor's probe requests failed",
                {"errors": probe.errors},
                ["the API key (--key) and model (--model) the probe used", "the server log for the probe's requests"],
            ),
        )
    findings.append(_gate_pointer(options.url, model))
    return DoctorReport(options.url, round(elapsed, 3), model, health, findings, obs)
