"""Several models behind one server (serve/model_registry.py, serve/routing/): two tiny models
side by side, each answering as it does alone; aliases; routes by tenant, task and prompt
length; fallback to another model when every engine of a model is killed, and to a remote
pagoda server past one that is down; tenants restricted to models or kept from fallbacks."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.http_client.server_process import free_port
from pagoda.http_client.sse import iter_sse_events
from pagoda.serve.admission.tenants import TenantRegistry, parse_tenants
from pagoda.serve.app import build_app
from pagoda.serve.connections import http_config
from pagoda.serve.model_registry import ModelRegistry, ServedModel
from pagoda.serve.models_file import FallbackTarget, RemoteEndpoint, parse_models_file
from pagoda.serve.settings import ServerSettings
from server_utils import MODEL_NAME, TOKENIZER_FILES, LiveServer, start_server

TIMEOUT_S = 60
ROUTES = """
models:
  - {name: alpha, model: x}
  - {name: beta, model: x}
routes:
  - name: auto
    rules:
      - {tenant: acme, model: beta}
      - {task: summarize, model: alpha}
      - {max_prompt_tokens: 8, model: alpha}
      - {model: beta}
"""
TENANTS = {
    "tenants": {
        "acme": {"api_keys": ["sk-acme"]},
        "other": {"api_keys": ["sk-other"]},
        "strict": {"api_keys": ["sk-strict"], "allow_fallback": False},
        "alpha-only": {"api_keys": ["sk-alpha"], "models": ["alpha"]},
    }
}


def build_model_dir(directory: Path, seed: int) -> Path:
    from model_factory import build_model
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).get_vocab_size()
    build_model(directory, "llama", seed=seed, vocab_size=vocab_size)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory


def engine(model_dir: Path, transport: str = "thread") -> AsyncLLM:
    return AsyncLLM(
        EngineConfig(model=str(model_dir), num_threads=1, num_kv_blocks=128, max_num_seqs=8), transport=transport
    )


class Served:
    def __init__(self, registry: ModelRegistry, settings: ServerSettings) -> None:
        self.registry = registry
        self.app = build_app(registry, settings)
        self.server = uvicorn.Server(
            http_config(self.app, settings, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.registry.shutdown()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return build_model_dir(root / "alpha", seed=0), build_model_dir(root / "beta", seed=1)


@pytest.fixture(scope="module")
def remote(model_dirs: tuple[Path, Path]) -> Iterator[LiveServer]:
    """A second pagoda server (serving beta's weights as tiny-llama): the remote fallback."""
    live = start_server(model_dirs[1])
    yield live
    live.stop()


@pytest.fixture(scope="module")
def served(model_dirs: tuple[Path, Path], remote: LiveServer) -> Iterator[Served]:
    alpha_dir, beta_dir = model_dirs
    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    models = [
        ServedModel("alpha", engine(alpha_dir), str(alpha_dir), aliases=("a", "first")),
        ServedModel("beta", engine(beta_dir), str(beta_dir)),
        # gamma runs alpha's weights in an engine process of its own, which the tests kill.
        ServedModel("gamma", engine(alpha_dir, "process"), str(alpha_dir), fallbacks=(FallbackTarget(model="a"),)),
        # delta is shut down by the tests; its fallbacks are remote: one down, one up.
        ServedModel(
            "delta",
            engine(alpha_dir),
            str(alpha_dir),
            fallbacks=(
                FallbackTarget(remote=RemoteEndpoint(down, "x", connect_timeout=1, first_byte_timeout=5)),
                FallbackTarget(
                    remote=RemoteEndpoint(
                        remote.base_url, MODEL_NAME, api_key_env="REMOTE_KEY", connect_timeout=1, first_byte_timeout=10
                    )
                ),
            ),
        ),
    ]
    registry = ModelRegistry(models, parse_models_file(ROUTES).routes)
    live = Served(registry, ServerSettings(tenants=TenantRegistry(parse_tenants(TENANTS))))
    yield live
    live.stop()


def complete(
    url: str,
    model: str,
    prompt: str = "Hello there",
    key: str = "sk-other",
    headers: dict[str, str] | None = None,
    **body: Any,
) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        timeout=TIMEOUT_S,
        headers={"authorization": f"Bearer {key}", **(headers or {})},
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, **body},
    )


def test_two_models_side_by_side_answer_as_each_does_alone(
    served: Served, model_dirs: tuple[Path, Path], remote: LiveServer
) -> None:
    alpha = complete(served.url, "alpha")
    beta = complete(served.url, "beta")
    assert alpha.status_code == beta.status_code == 200, (alpha.text, beta.text)
    assert alpha.json()["model"] == "alpha" and beta.json()["model"] == "beta"
    assert alpha.headers["x-pagoda-route"] == "model:alpha"
    # beta's weights served alone (the remote server) answer exactly as beta does here.
    alone = complete(remote.url, MODEL_NAME)
    assert beta.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert alpha.json()["choices"][0]["text"] != beta.json()["choices"][0]["text"]
    alpha_alone = start_server(model_dirs[0])
    try:
        assert complete(alpha_alone.url, MODEL_NAME).json()["choices"][0]["text"] == alpha.json()["choices"][0]["text"]
    finally:
        alpha_alone.stop()


def test_every_alias_answers_under_the_canonical_name(served: Served) -> None:
    texts = set()
    for name in ("alpha", "a", "first"):
        response = complete(served.url, name)
        assert response.status_code == 200 and response.json()["model"] == "alpha"
        texts.add(response.json()["choices"][0]["text"])
    assert len(texts) == 1
    assert complete(served.url, "nope").status_code == 404


def test_models_lists_models_aliases_and_routes_for_the_tenant(served: Served) -> None:
    def ids(key: str) -> list[str]:
        response = httpx.get(f"{served.url}/v1/models", headers={"authorization": f"Bearer {key}"})
        return [card["id"] for card in response.json()["data"]]

    assert ids("sk-other") == ["alpha", "a", "first", "beta", "gamma", "delta", "auto"]
    assert ids("sk-alpha") == ["alpha", "a", "first"]
    assert complete(served.url, "beta", key="sk-alpha").status_code == 404
    assert complete(served.url, "a", key="sk-alpha").status_code == 200


@pytest.mark.parametrize(
    "key, prompt, headers, metadata, model, rule",
    [
        ("sk-acme", "hi", {}, None, "beta", 0),  # by tenant
        ("sk-other", "a long prompt " * 20, {}, {"task": "summarize"}, "alpha", 1),  # by task (metadata)
        ("sk-other", "a long prompt " * 20, {"x-pagoda-task": "summarize"}, None, "alpha", 1),  # by task header
        ("sk-other", "hi", {}, None, "alpha", 2),  # by prompt length
        ("sk-other", "a long prompt " * 20, {}, None, "beta", 3),  # the default
    ],
)
def test_a_route_sends_each_request_by_the_first_rule_that_matches(
    served: Served, key: str, prompt: str, headers: dict[str, str], metadata: dict | None, model: str, rule: int
) -> None:
    extra = {"metadata": metadata} if metadata else {}
    response = complete(served.url, "auto", prompt, key=key, headers=headers, **extra)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    assert response.headers["x-pagoda-route"] == f"route:auto:{model}"
    samples = metric_samples(served.url)
    assert (
        samples[("pagoda:model_route_decisions_total", (("model_name", model), ("route", "auto"), ("rule", str(rule))))]
        >= 1
    )


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_and_health_are_per_model(served: Served) -> None:
    complete(served.url, "beta")
    samples = metric_samples(served.url)
    models = {dict(labels).get("model_name") for name, labels in samples if name == "pagoda:request_success_total"}
    assert {"alpha", "beta"} <= models
    body = httpx.get(f"{served.url}/health").json()
    assert set(body["models"]) == {"alpha", "beta", "gamma", "delta"}
    assert body["models"]["gamma"]["status"] == "ok" and body["models"]["gamma"]["pid"]


def wait_for(condition: Any, what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_a_killed_model_falls_back_to_another_marked_and_counted(served: Served) -> None:
    gamma = served.registry.model("gamma")
    assert gamma is not None and complete(served.url, "gamma").json()["model"] == "gamma"
    os.kill(gamma.llm.engine_pid, signal.SIGKILL)  # type: ignore[attr-defined]
    wait_for(lambda: not gamma.llm.is_alive, "gamma's engine to be seen dead")
    expected = complete(served.url, "alpha").json()["choices"][0]["text"]
    response = complete(served.url, "gamma")
    assert response.status_code == 200, response.text
    assert response.headers["x-pagoda-route"] == "fallback:alpha"
    assert response.json()["model"] == "alpha" and response.json()["choices"][0]["text"] == expected
    provenance = served.registry.model("alpha").context.provenance.find(response.headers["x-pagoda-provenance"])
    assert provenance is not None and provenance.route.model == "alpha" and provenance.route.fallback
    # A stream falls back before its first event; every chunk names the model that answers.
    with httpx.stream(
        "POST",
        f"{served.url}/v1/chat/completions",
        timeout=TIMEOUT_S,
        headers={"authorization": "Bearer sk-other"},
        json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    ) as stream:
        assert stream.headers["x-pagoda-route"] == "fallback:alpha"
        chunks = [event.json() for event in iter_sse_events(stream.iter_lines()) if not event.done]
    assert chunks and {chunk["model"] for chunk in chunks} == {"alpha"}
    # Anthropic's Messages and OpenAI's Responses fall back the same way.
    for path, body in (
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"max_output_tokens": 4, "input": "hi"}),
    ):
        answer = httpx.post(
            f"{served.url}{path}",
            timeout=TIMEOUT_S,
            headers={"authorization": "Bearer sk-other"},
            json={"model": "gamma", **body},
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-pagoda-route"] == "fallback:alpha" and answer.json()["model"] == "alpha"
    samples = metric_samples(served.url)
    assert (
        samples[
            (
                "pagoda:model_fallbacks_total",
                (("fallback", "alpha"), ("model_name", "gamma"), ("reason", "no_live_replica")),
            )
        ]
        >= 2
    )
    # A tenant whose policy forbids fallbacks gets the model's own 503.
    refused = complete(served.url, "gamma", key="sk-strict")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"


def test_a_remote_fallback_that_is_down_is_skipped_and_the_next_answers(
    served: Served, remote: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    delta = served.registry.model("delta")
    assert delta is not None
    delta.llm.shutdown()
    expected = complete(remote.url, MODEL_NAME).json()["choices"][0]["text"]
    started = time.monotonic()
    response = complete(served.url, "delta")
    assert time.monotonic() - started < TIMEOUT_S / 2
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL_NAME and response.json()["choices"][0]["text"] == expected
    assert response.headers["x-pagoda-route"] == f"fallback:{MODEL_NAME}@{remote.base_url}"
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        timeout=TIMEOUT_S,
        headers={"authorization": "Bearer sk-other"},
        json={"model": "delta", "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "stream": True},
    ) as stream:
        text = "".join(
            event.json()["choices"][0]["text"]
            for event in iter_sse_events(stream.iter_lines())
            if not event.done and event.json()["choices"]
        )
    assert text == expected
    samples = metric_samples(served.url)
    skipped = [
        value
        for (name, labels), value in samples.items()
        if name == "pagoda:remote_fallback_skipped_total" and dict(labels)["reason"] == "connect_error"
    ]
    assert skipped and skipped[0] >= 2


def test_served_model_name_gives_aliases_on_the_command_line(model_dirs: tuple[Path, Path]) -> None:
    from server_utils import start_serve_process

    port = free_port()
    process = start_serve_process(
        model_dirs[0],
        port,
        "--served-model-name",
        "main",
        "alt",
        "other",
        "--max-num-seqs",
        "4",
        "--num-kv-blocks",
        "64",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for name in ("main", "alt", "other"):
            response = complete(url, name)
            assert response.status_code == 200 and response.json()["model"] == "main"
        assert complete(url, "tiny").status_code == 404
        ids = [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]]
        assert ids == ["main", "alt", "other"]
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
