"""Replica pools and route rules (request-shape routing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.config import DeploymentConfig
from pagoda.replicas.policies import RouteRequest
from pagoda.replicas.pools import RouteRules, parse_replica_pools

RULES_YAML = """\
default: chat
rules:
  - pool: long
    min_prompt_tokens: 100
  - pool: batch
    tenants: [nightly]
    models: coder
"""


def route(length: int, tenant: str | None = None, model: str | None = None) -> RouteRequest:
    return RouteRequest(list(range(length)), 8, tenant=tenant, model=model)


def test_parse_replica_pools() -> None:
    assert parse_replica_pools("chat=2,long=1") == ["chat", "chat", "long"]
    assert parse_replica_pools(" a=1 ") == ["a"]
    for bad in ("chat", "chat=0", "chat=2,chat=1", "=2", "chat=x", "a b=1"):
        with pytest.raises(ValueError):
            parse_replica_pools(bad)


def test_rules_pick_pools_first_match_wins(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES_YAML)
    rules = RouteRules.from_file(path)
    assert rules.pool_of(route(150)) == "long"
    assert rules.pool_of(route(150, tenant="nightly", model="coder")) == "long"
    assert rules.pool_of(route(10, tenant="nightly", model="coder")) == "batch"
    assert rules.pool_of(route(10, tenant="nightly", model="other")) == "chat"
    assert rules.pool_of(route(10)) == "chat"
    json_path = tmp_path / "rules.json"
    json_path.write_text(json.dumps({"rules": [{"pool": "long", "min_prompt_tokens": 5}]}))
    assert RouteRules.from_file(json_path).pool_of(route(3)) is None  # no default: any replica
    rules.check_pools({"chat", "long", "batch"})
    broken = tmp_path / "broken.yaml"
    broken.write_text("rules: [pool: long\n")
    with pytest.raises(ValueError, match="YAML"):
        RouteRules.from_file(broken)
    with pytest.raises(ValueError, match="batch"):
        rules.check_pools({"chat", "long"})


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "mapping"),
        ({"rules": [{"min_prompt_tokens": 3}]}, "rule 1"),
        ({"rules": [{"pool": "a", "min_prompt_tokens": -1}]}, "non-negative"),
        ({"rules": [{"pool": "a", "tenant": "x"}]}, "unknown keys"),
        ({"rules": [{"pool": "a", "tenants": [1]}]}, "list of names"),
        ({"rules": [], "fallback": "a"}, "unknown keys"),
    ],
)
def test_bad_rules_are_refused_with_the_reason(data: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouteRules.from_dict(data)


def test_config_checks_pools_against_replicas() -> None:
    DeploymentConfig(data_parallel_size=3, replica_pools="chat=2,long=1")
    with pytest.raises(ValueError, match="add up to 3"):
        DeploymentConfig(data_parallel_size=2, replica_pools="chat=2,long=1")
    with pytest.raises(ValueError, match="replica_pools too"):
        DeploymentConfig(data_parallel_size=2, route_rules="rules.yaml")
    with pytest.raises(ValueError, match="router"):
        DeploymentConfig(router="random")
    with pytest.raises(ValueError, match="data_parallel_size"):
        DeploymentConfig(data_parallel_size=0)


def test_ray_is_imported_only_where_the_ray_backend_runs() -> None:
    """Ray is optional: no module imports it at load time (only inside the functions that run
    with --distributed-executor-backend ray)."""
    import ast

    package = Path(__file__).resolve().parents[2] / "pagoda"
    eager = []
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            eager += [f"{path.relative_to(package)}: {n}" for n in names if n.split(".")[0] == "ray"]
    assert eager == []
