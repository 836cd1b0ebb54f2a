"""A request's `priority` under --scheduling-policy priority, bounded by its tenant's range."""

from __future__ import annotations

import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagoda.http_client.sse import iter_sse_events
from pagoda.serve.admission.tenants import TenantRegistry, parse_tenants
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """
tenants:
  urgent: {api_keys: [key-urgent], priority: -5}
  batch: {api_keys: [key-batch], priority: 5, priority_range: [0, 10]}
  plain: {api_keys: [key-plain], priority: 3}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("priority")
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(
        build_tiny_model(root / "model"),
        tenants=TenantRegistry.from_file(keys),
        engine={"scheduling_policy": "priority", "max_num_seqs": 1},
    )
    yield live
    live.stop()


def completion(key: str, **fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0, **fields}


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_queued_requests_run_in_the_order_of_their_priority(server: LiveServer) -> None:
    """The one slot is held by a higher-ranked tenant's stream while four requests queue; once it
    ends they run one at a time, lowest priority value first (a request without one runs at its
    tenant's priority). Each request's first token can only come after the previous one is
    done, so the order of first tokens is the order they ran in."""
    started: dict[str, float] = {}

    def run(name: str, priority: int | None) -> None:
        body = completion(
            "key-batch",
            max_tokens=24,
            ignore_eos=True,
            stream=True,
            **({"priority": priority} if priority is not None else {}),
        )
        with httpx.stream(
            "POST", server.base_url + "/completions", json=body, headers=headers("key-batch"), timeout=120
        ) as response:
            assert response.status_code == 200
            for event in iter_sse_events(response.iter_lines()):
                if not event.done and event.json()["choices"]:
                    started.setdefault(name, time.monotonic())

    # As long as the context allows: it is aborted long before it ends.
    blocker_body = completion("key-urgent", max_tokens=server.llm.max_model_len - 8, ignore_eos=True, stream=True)
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(4) as pool:
        with http.stream(
            "POST", server.base_url + "/completions", json=blocker_body, headers=headers("key-urgent")
        ) as blocker:
            assert blocker.status_code == 200
            lines = blocker.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it holds the slot
            futures = [
                pool.submit(run, name, priority)
                for name, priority in (("eight", 8), ("zero", 0), ("six", 6), ("default", None))
            ]
            wait_for(lambda: server.stats().num_waiting == 4)
        # Leaving the stream aborts the blocker: the queue runs.
        for future in futures:
            future.result(timeout=120)
    assert sorted(started, key=started.__getitem__) == ["zero", "default", "six", "eight"]
    assert server.wait_idle().num_waiting == 0


@pytest.mark.parametrize(
    "key, priority, status",
    [
        ("key-batch", 0, 200),
        ("key-batch", 10, 200),
        ("key-batch", -1, 400),
        ("key-batch", 11, 400),
        ("key-plain", 3, 200),
        ("key-plain", 50, 200),
        ("key-plain", 2, 400),
        ("key-urgent", -5, 200),
        ("key-batch", 2**70, 400),
        ("key-batch", "high", 400),
    ],
)
def test_a_tenant_cannot_jump_the_queue_past_its_floor(server: LiveServer, key: str, priority, status: int) -> None:
    response = httpx.post(
        server.base_url + "/completions", json=completion(key, priority=priority), headers=headers(key), timeout=60
    )
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] == "priority"


def test_priority_range_must_hold_the_tenants_priority(tmp_path: Path) -> None:
    assert parse_tenants({"tenants": {"a": {"api_keys": ["k"], "priority_range": [-2, 4]}}})[
        "k"
    ].limits.priority_range == (-2, 4)
    for spec, message in (
        ({"priority_range": [5, 1]}, "lowest, highest"),
        ({"priority_range": [1, 5]}, "outside priority_range"),
        ({"priority_range": "0-5"}, "lowest, highest"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_tenants({"tenants": {"a": {"api_keys": ["k"], **spec}}})
