"""/v1/models never lists what cannot serve the caller: a route whose rules may pick a model the
tenant may not use is left off its list (calling it could answer "does not exist")."""

from __future__ import annotations

import httpx
import pytest

from pagoda.serve.admission.tenants import TenantRegistry, parse_tenants
from pagoda.serve.model_registry import ModelRegistry, ServedModel
from pagoda.serve.models_file import parse_models_file
from pagoda.serve.settings import ServerSettings
from test_models import Served, build_model_dir, engine

ROUTES = """
models:
  - {name: alpha, model: x}
  - {name: beta, model: x}
routes:
  - name: auto
    rules:
      - {max_prompt_tokens: 8, model: alpha}
      - {model: beta}
  - name: cheap
    rules:
      - {tenant: partial, model: alpha}
      - {model: beta}
"""
TENANTS = {
    "tenants": {
        "full": {"api_keys": ["sk-full"]},
        "partial": {"api_keys": ["sk-partial"], "models": ["alpha", "auto", "cheap"]},
    }
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    directory = build_model_dir(tmp_path_factory.mktemp("listing") / "alpha", seed=0)
    registry = ModelRegistry(
        [
            ServedModel("alpha", engine(directory), str(directory)),
            ServedModel("beta", engine(directory), str(directory)),
        ],
        parse_models_file(ROUTES).routes,
    )
    live = Served(registry, ServerSettings(tenants=TenantRegistry(parse_tenants(TENANTS))))
    yield live
    live.stop()


def listed(served, key: str) -> set[str]:
    response = httpx.get(served.url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"]}


def test_a_route_that_may_pick_a_forbidden_model_is_not_listed(served) -> None:
    assert listed(served, "sk-full") == {"alpha", "beta", "auto", "cheap"}
    # auto may pick beta for a long prompt; cheap's rule for this tenant picks alpha, always.
    assert listed(served, "sk-partial") == {"alpha", "cheap"}
    for name in listed(served, "sk-partial"):
        response = httpx.post(
            served.url + "/v1/completions",
            headers={"authorization": "Bearer sk-partial"},
            json={"model": name, "prompt": "a long prompt " * 20, "max_tokens": 1},
            timeout=60,
        )
        assert response.status_code == 200, (name, response.text)
