"""Admission charges work, not HTTP requests: every prompt x n is a sequence against
--max-num-seqs, the queue and a tenant's concurrency cap; token quotas are reserved at
admission and settled at the end; what can never fit is a 400 that says the allowance; and a
full queue refuses before tokenizing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagoda.serve.admission.tenants import Tenant, TenantLimits, TenantRegistry
from pagoda.serve.admission.work import RequestWork
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

TENANTS = {
    "key-open": Tenant("open"),
    "key-capped": Tenant("capped", TenantLimits(max_concurrent_requests=4)),
    "key-quota": Tenant("quota", TenantLimits(tokens_per_minute=1000)),
    "key-small-quota": Tenant("small-quota", TenantLimits(tokens_per_minute=100)),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[LiveServer]:
    live = start_server(model_dir, engine={"max_num_seqs": 4}, tenants=TenantRegistry(TENANTS), max_queued_requests=16)
    yield live
    live.stop()


def post(server: LiveServer, key: str, timeout: float = 60, **body: Any) -> httpx.Response:
    payload = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(
        server.base_url + "/completions", json=payload, timeout=timeout, headers={"Authorization": f"Bearer {key}"}
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


def wait_released(server: LiveServer, key: str) -> None:
    """Until the tenant's requests have let go of their holds (close runs after the answer)."""
    ctx = server.app.state.ctx
    tenant = ctx.settings.tenants.authenticate(key)
    deadline = time.monotonic() + 10
    while ctx.limiter.in_flight(tenant) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ctx.limiter.in_flight(tenant) == 0


def test_samples_of_n_count_against_max_num_seqs(server: LiveServer) -> None:
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, server.stats().num_running)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        response = post(
            server, "key-open", prompt=["one", "two two", "three three three"], n=4, max_tokens=48, ignore_eos=True
        )
    finally:
        done.set()
        watcher.join()
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 12 and all(c["finish_reason"] == "length" for c in choices)
    assert 1 <= peak <= 4
    server.wait_idle()


def test_seeded_samples_are_the_same_whatever_max_num_seqs(server: LiveServer, model_dir) -> None:
    body = {"prompt": ["alpha", "beta"], "n": 4, "max_tokens": 8, "seed": 7, "temperature": 1.0, "ignore_eos": True}
    texts = [c["text"] for c in post(server, "key-open", **body).json()["choices"]]
    roomy = start_server(model_dir, engine={"max_num_seqs": 16})
    try:
        assert [c["text"] for c in post(roomy, "key-open", **body).json()["choices"]] == texts
    finally:
        roomy.stop()


def test_tenant_concurrency_cap_counts_sequences(model_dir) -> None:
    live = start_server(model_dir, engine={"max_num_seqs": 16}, tenants=TenantRegistry(TENANTS))
    try:
        refused = post(live, "key-capped", prompt=[f"prompt {i}" for i in range(11)], n=10)
        assert refused.status_code == 400
        error = error_of(refused)
        assert "max_concurrent_requests" in error["message"] and "110 sequences" in error["message"]
        assert "limit of 4" in error["message"] and error["param"] == "n"
        within = post(live, "key-capped", prompt=["a", "b"], n=2)
        assert within.status_code == 200 and len(within.json()["choices"]) == 4
        wait_released(live, "key-capped")
    finally:
        live.stop()


def test_token_quota_is_reserved_at_admission_and_settled_at_the_end(server: LiveServer) -> None:
    key = "key-quota"  # 1000 tokens per minute
    long_body = {"prompt": "hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
        with client.stream("POST", "/completions", json={"model": MODEL_NAME, **long_body}) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)  # admitted: its ~452 tokens are reserved now
            # Together with the first this one could exceed the quota: refused at once,
            # whether the first is still running or has finished.
            second = post(server, key, n=2, max_tokens=300)
            assert second.status_code == 429, second.text
            message = error_of(second)["message"]
            assert "1000 tokens per minute" in message and "up to 602 tokens" in message
            assert int(second.headers["Retry-After"]) >= 1
        # The first stream is cut a few tokens in: the quota gets back what it did not use,
        # so a request that needs most of the quota fits again at once.
    wait_released(server, key)
    third = post(server, key, n=2, max_tokens=400, ignore_eos=True)
    assert third.status_code == 200, third.text
    assert third.json()["usage"]["total_tokens"] == third.json()["usage"]["prompt_tokens"] + 800
    wait_released(server, key)


def test_what_can_never_fit_is_a_400_with_the_allowance(server: LiveServer) -> None:
    over_quota = post(server, "key-small-quota", max_tokens=200)
    assert over_quota.status_code == 400
    error = error_of(over_quota)
    assert "100 tokens per minute" in error["message"] and error["param"] == "max_tokens"
    over_queue = post(server, "key-open", prompt=[f"p{i}" for i in range(5)], n=4)
    assert over_queue.status_code == 400
    error = error_of(over_queue)
    assert "20 sequences" in error["message"] and "at most 16 sequences" in error["message"]
    assert "--max-queued-requests" in error["message"] and error["code"] == "limit_exceeded"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagoda:request_rejected_total{model_name="tiny-llama",reason="invalid_request"}' in metrics
    wait_released(server, "key-small-quota")


def test_a_full_queue_refuses_before_tokenizing(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = server.app.state.ctx
    tokenizer = ctx.llm.tokenizer
    encoded: list[str] = []
    encode = tokenizer.encode

    def counting_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append(text)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)
    # Fill the queue (16 sequences) as waiting requests would; nothing else runs meanwhile.
    held = ctx.admission.reserve(RequestWork(4, 4))
    try:
        for i in range(5):
            refused = post(server, "key-open", prompt=f"refused {i}")
            assert refused.status_code == 503 and "Retry-After" in refused.headers
            assert "16 sequences queued" in error_of(refused)["message"]
        assert not [text for text in encoded if text.startswith("refused")]
    finally:
        for slot in held:
            slot.leave()
    assert post(server, "key-open", prompt="admitted").status_code == 200
    assert "admitted" in encoded
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagoda:request_refusal_seconds_count{model_name="tiny-llama",reason="overloaded"} 5.0' in metrics
