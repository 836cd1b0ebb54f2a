"""The models file (serve/models_file.py): what it reads, and every mistake named by its line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.serve.models_file import ModelsFileError, parse_models_file
from server_utils import REPO_ROOT

GOOD = """\
models:
  - name: small
    model: pagoda-coder
    aliases: [fast, s]
    max_model_len: 256
    data_parallel_size: 2
    fallbacks:
      - large
      - {url: "http://other:8000/v1/", model: qwen, api_key_env: OTHER_KEY, connect_timeout: 1}
  - name: large
    model: pagoda-coder
routes:
  - name: auto
    rules:
      - {tenant: [acme, beta], class: cheap, model: fast}
      - {min_prompt_tokens: 100, max_prompt_tokens: 2000, model: large}
      - {model: small}
"""


def test_a_good_file_reads_into_models_routes_and_fallbacks() -> None:
    parsed = parse_models_file(GOOD, "models.yaml")
    small, large = parsed.models
    assert (small.name, small.aliases, small.line) == ("small", ("fast", "s"), 2)
    assert small.engine == {"max_model_len": 256} and small.deployment == {"data_parallel_size": 2}
    assert small.fallbacks[0].model == "large"
    remote = small.fallbacks[1].remote
    assert remote is not None and (remote.url, remote.model, remote.api_key_env, remote.connect_timeout) == (
        "http://other:8000/v1",
        "qwen",
        "OTHER_KEY",
        1.0,
    )
    assert large.fallbacks == () and large.engine == {}
    (route,) = parsed.routes
    assert [rule.model for rule in route.rules] == ["fast", "large", "small"]
    assert route.rules[0].tenants == {"acme", "beta"} and route.rules[0].classes == {"cheap"}
    assert (route.rules[1].min_prompt_tokens, route.rules[1].max_prompt_tokens, route.rules[1].line) == (100, 2000, 16)


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("models:\n  - name: a\n    model: m\n    colour: red\n", 4, "unknown key 'colour'"),
        (
            "models:\n  - name: a\n    model: m\n  - name: b\n    model: m\n    aliases: [a]\n",
            4,
            "the name 'a' is taken twice",
        ),
        ("models:\n  - name: a\n    model: m\n  - name: a\n    model: m\n", 4, "the name 'a' is taken twice"),
        (
            "models:\n  - {name: a, model: m}\nroutes:\n  - name: r\n    rules:\n      - {model: b}\n",
            6,
            "route 'r' sends requests to 'b', which is not a model of this file",
        ),
        (
            "models:\n  - {name: a, model: m, fallbacks: [b]}\n  - {name: b, model: m, fallbacks: [c]}\n"
            "  - {name: c, model: m, fallbacks: [a]}\n",
            2,
            "fallback cycle: a -> b -> c -> a",
        ),
        ("models:\n  - {name: a, model: m, fallbacks: [zzz]}\n", 2, "falls back to 'zzz'"),
        ("models:\n  - name: a\n    model: m\n    dtype: float99\n", 4, "dtype"),
        ("models:\n  - name: a\n    model: m\n    data_parallel_size: 0\n", 4, "data_parallel_size"),
        ("models:\n  - name: a\n    model: m\n    min_replicas: 0\n", 4, "min_replicas must be >= 1"),
        ("models:\n  - {name: a, model: m, fallbacks: [{url: 'ftp://x', model: q}]}\n", 2, "http://"),
        (
            "models:\n  - {name: a, model: m}\nroutes:\n  - {name: a, rules: [{model: a}]}\n",
            4,
            "has the name of model 'a'",
        ),
        ("models:\n  - {name: a}\n", 2, "needs `model`"),
        ("models: []\n", 1, "lists no model"),
        ("models:\n  - {name: a, model: m\n", 3, "not valid YAML"),
        ("routes: []\n", 1, "needs a `models` list"),
    ],
)
def test_each_mistake_names_its_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ModelsFileError) as error:
        parse_models_file(text, "models.yaml")
    assert str(error.value).startswith(f"models.yaml:{line}: "), str(error.value)
    assert message in str(error.value)


def test_serve_refuses_a_bad_models_file_at_startup_naming_the_line(tmp_path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: a, model: pagoda-coder, fallbacks: [a]}\n")
    result = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--models", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert f"pagoda serve: {path}:2: fallback cycle: a -> a" in result.stderr.strip().splitlines()[-1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_plan_says_whether_the_models_fit_naming_each(tmp_path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n  - {name: a, model: pagoda-coder, data_parallel_size: 2}\n"
        "  - {name: b, model: pagoda-coder, max_model_len: 128}\n"
    )
    fits = run_cli("plan", "--models", str(path), "--memory", "8GiB")
    assert fits.returncode == 0, fits.stderr
    lines = fits.stdout.splitlines()
    assert lines[0].startswith(f"{path}:2: a: 2 x (") and lines[1].startswith(f"{path}:3: b: 1 x (")
    assert "128-token context" in lines[1] and "KV pool" in lines[1] and lines[-1].endswith("the models fit")
    too_small = run_cli("plan", "--models", str(path), "--memory", "16MiB")
    assert too_small.returncode == 1 and too_small.stdout.splitlines()[-1].endswith("the models do NOT fit")


def test_serve_refuses_models_that_cannot_fit_before_starting_any(tmp_path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n  - {name: a, model: pagoda-coder}\n"
        "  - {name: huge, model: pagoda-coder, data_parallel_size: 1000000}\n"
    )
    result = run_cli("serve", "--models", str(path), "--device", "cpu")
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("pagoda serve: the models do not fit this machine's memory: ")
    assert f"{path}:2: a: 1 x (" in message and f"{path}:3: huge: 1000000 x (" in message


def test_serve_refuses_min_replicas_above_max_replicas_naming_the_model(tmp_path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: a, model: pagoda-coder, min_replicas: 3, max_replicas: 2}\n")
    result = run_cli("serve", "--models", str(path), "--device", "cpu")
    assert result.returncode != 0
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"pagoda serve: {path}:2: model 'a': min_replicas (3) is more than max_replicas (2)"
    )


def test_the_models_of_a_file_share_the_free_memory_for_their_kv_pools() -> None:
    from pagoda.config import EngineConfig

    text = GOOD.replace("  - name: large\n", "  - name: large\n    kv_cache_memory_share: 0.3\n")
    small, large = parse_models_file(text, "models.yaml").models
    defaults = EngineConfig()
    assert small.engine_config(defaults, 2).kv_cache_memory_share == defaults.kv_cache_memory_share / 2
    assert large.engine_config(defaults, 2).kv_cache_memory_share == 0.3  # its own share, as it set it
    sized = EngineConfig(kv_cache_memory="1GiB")
    assert small.engine_config(sized, 2).kv_cache_memory_share == sized.kv_cache_memory_share  # no share in use
