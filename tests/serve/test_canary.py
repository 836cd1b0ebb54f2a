"""The live canary (serve/routing/canary.py): the seeded weight split, tenant scoping, automatic
rollback on an injected error rate and on shadow output drift, promotion after a clean period,
the admin endpoints, and a rollback that leaves both models loaded and stable serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagoda.serve.admission.tenants import TenantRegistry, parse_tenants
from pagoda.serve.model_registry import ModelRegistry, ServedModel
from pagoda.serve.models_file import ModelsFileError, parse_models_file
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.serve.routing.canary import CanaryController
from pagoda.serve.settings import ServerSettings
from test_models import Served, build_model_dir, engine, metric_samples, wait_for

TIMEOUT_S = 60
MODELS = """
models:
  - {name: alpha, model: x}
  - {name: beta, model: x}
canary:
  stable: alpha
  candidate: beta
"""
TENANTS = {
    "tenants": {
        "acme": {"api_keys": ["sk-acme"]},
        "other": {"api_keys": ["sk-other"]},
        "ops": {"api_keys": ["sk-ops"], "admin": True},
    }
}


def canary_spec(extra: str) -> Any:
    spec = parse_models_file(MODELS + "".join(f"  {line}\n" for line in extra.strip().splitlines())).canary
    assert spec is not None
    return spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def controller(extra: str, clock: Clock | None = None) -> CanaryController:
    models = [ServedModel("alpha", llm=None, model_path="x"), ServedModel("beta", llm=None, model_path="x")]  # type: ignore[arg-type]
    return CanaryController(canary_spec(extra), ModelRegistry(models), clock=clock or Clock())


def record(model: str, status: int = 200, ttft: float = 0.01) -> RequestLogRecord:
    return RequestLogRecord(
        request_id="r",
        endpoint="completions",
        model=model,
        status=status,
        output_tokens=8,
        ttft_s=ttft,
        e2e_s=ttft + 0.07,
    )


def test_bad_canary_config_names_the_line() -> None:
    for extra, message in (
        ("weight: 1.5", ":8: weight must be a number from 0 to 1"),
        ("rules: {error_rat: 0.1}", ":8: the canary's rules: unknown key 'error_rat'"),
        ("shadow: {sample: 2}", ":8: shadow sample must be a number from 0 to 1"),
    ):
        with pytest.raises(ModelsFileError, match=message):
            canary_spec(extra)
    with pytest.raises(ModelsFileError, match=":7: the canary's candidate 'gamma' is not a model"):
        parse_models_file(MODELS.replace("candidate: beta", "candidate: gamma"))


def test_the_weight_splits_traffic_within_tolerance_and_is_reproducible() -> None:
    def split() -> list[bool]:
        canary = controller("weight: 0.25\nseed: 7")
        return [canary.chooses_candidate(canary.stable, "alpha", "acme") for _ in range(200)]

    chosen = split()
    assert 30 <= sum(chosen) <= 70  # 50 expected
    assert chosen == split()
    canary = controller("weight: 0.25\nseed: 7")
    assert not any(canary.chooses_candidate(canary.candidate, "beta", "acme") for _ in range(50))


def test_a_tenant_scoped_canary_takes_only_those_tenants() -> None:
    canary = controller("weight: 1\ntenants: [acme]\nroutes: [alpha]")
    assert canary.chooses_candidate(canary.stable, "alpha", "acme")
    assert not canary.chooses_candidate(canary.stable, "alpha", "other")
    assert not canary.chooses_candidate(canary.stable, "auto", "acme")  # not a listed route


def test_an_error_rate_rolls_back_and_a_clean_period_promotes() -> None:
    clock = Clock()
    canary = controller("min_requests: 5\nwindow_s: 10\npromote_after_s: 30\nrules: {error_rate: 0.2}", clock)
    for _ in range(10):
        canary.observe(record("alpha"))
        canary.observe(record("beta", status=500 if _ % 2 else 200))
    assert canary.state == "rolled_back"
    assert canary.events[-1].by == "error_rate"
    assert not canary.chooses_candidate(canary.stable, "alpha", "acme")

    clock = Clock()
    canary = controller("min_requests: 5\nwindow_s: 10\npromote_after_s: 30\nrules: {error_rate: 0.2}", clock)
    for _ in range(40):
        clock.now += 1
        canary.observe(record("alpha"))
        canary.observe(record("beta"))
        canary.evaluate()
    assert canary.state == "promoted" and canary.events[-1].by == "clean_period"
    assert canary.chooses_candidate(canary.stable, "alpha", "other")  # all of stable's traffic now


def test_a_slow_candidate_breaks_the_ttft_rule() -> None:
    canary = controller("min_requests: 5\nrules: {ttft_p99_ratio: 2}")
    for _ in range(6):
        canary.observe(record("alpha", ttft=0.01))
        canary.observe(record("beta", ttft=0.05))
    assert canary.state == "rolled_back" and canary.events[-1].by == "ttft_p99_ratio"


# ---- one live server: alpha stable, beta (other weights) the candidate of tenant acme ----------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("models")
    alpha_dir, beta_dir = build_model_dir(root / "alpha", seed=0), build_model_dir(root / "beta", seed=1)
    spec = canary_spec(
        "weight: 1\ntenants: [acme]\nmin_requests: 100\n"
        "shadow: {sample: 1, max_tokens: 8}\nrules: {output_mismatch_rate: 0}"
    )
    registry = ModelRegistry(
        [ServedModel("alpha", engine(alpha_dir), str(alpha_dir)), ServedModel("beta", engine(beta_dir), str(beta_dir))],
        canary=spec,
    )
    live = Served(registry, ServerSettings(tenants=TenantRegistry(parse_tenants(TENANTS))))
    yield live
    live.stop()


def complete(url: str, key: str, model: str = "alpha") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=TIMEOUT_S,
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
    )


def admin(url: str, method: str, path: str, key: str = "sk-ops") -> httpx.Response:
    return httpx.request(
        method, f"{url}/admin/canary{path}", timeout=TIMEOUT_S, headers={"authorization": f"Bearer {key}"}
    )


def test_canary_requests_are_marked_in_the_header_body_and_provenance(served: Served) -> None:
    answer = complete(served.url, "sk-acme")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pagoda-route"] == "canary:beta"
    assert answer.json()["model"] == "beta"
    record = admin(served.url, "GET", "").json()
    assert record["state"] == "running" and record["windows"]["beta"]["requests"] == 1
    provenance = httpx.get(
        f"{served.url}/admin/provenance/{answer.headers['x-pagoda-provenance']}",
        headers={"authorization": "Bearer sk-ops"},
        timeout=TIMEOUT_S,
    ).json()
    assert provenance["route"]["canary"] == "beta" and provenance["model"] == "beta"


def test_admin_endpoints_refuse_other_keys(served: Served) -> None:
    for method, path in (("GET", ""), ("POST", "/promote"), ("POST", "/rollback")):
        refused = admin(served.url, method, path, key="sk-acme")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_required"
    assert admin(served.url, "GET", "", key="sk-nope").status_code == 401


def test_shadow_drift_rolls_back_with_both_models_loaded_and_stable_serving(served: Served) -> None:
    # Another tenant's requests are stable's; each is replayed greedily to both models, whose
    # weights differ: the output drift breaks the rule.
    def rolled_back() -> bool:
        answer = complete(served.url, "sk-other")
        assert answer.status_code == 200 and answer.headers["x-pagoda-route"] == "model:alpha"
        return admin(served.url, "GET", "").json()["state"] == "rolled_back"

    wait_for(rolled_back, "the shadow drift to roll the canary back")
    status = admin(served.url, "GET", "").json()
    assert status["events"][-1]["by"] == "output_mismatch_rate"
    assert status["loaded"] == {"alpha": True, "beta": True}
    health = httpx.get(f"{served.url}/health").json()
    assert health["status"] == "ok" and set(health["models"]) == {"alpha", "beta"}
    for _ in range(3):  # acme's requests are stable's again
        answer = complete(served.url, "sk-acme")
        assert answer.status_code == 200 and answer.headers["x-pagoda-route"] == "model:alpha"
    assert complete(served.url, "sk-acme", model="beta").json()["model"] == "beta"  # still loaded
    samples = metric_samples(served.url)
    assert (
        samples[
            (
                "pagoda:canary_rollbacks_total",
                (("candidate", "beta"), ("rule", "output_mismatch_rate"), ("stable", "alpha")),
            )
        ]
        == 1
    )
    assert samples[("pagoda:canary_state", (("candidate", "beta"), ("stable", "alpha"), ("state", "rolled_back")))] == 1


def test_an_admin_promotes_and_rolls_back_by_hand(served: Served) -> None:
    assert admin(served.url, "POST", "/promote").json()["state"] == "promoted"
    answer = complete(served.url, "sk-other")
    assert answer.headers["x-pagoda-route"] == "canary:beta" and answer.json()["model"] == "beta"
    assert admin(served.url, "POST", "/rollback").json()["state"] == "rolled_back"
    assert complete(served.url, "sk-other").headers["x-pagoda-route"] == "model:alpha"
