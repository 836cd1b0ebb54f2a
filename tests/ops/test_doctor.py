"""`pagoda doctor`: each finding triggered by a real server configured to show it, a healthy
idle server with nothing above info, the exit code and the --json shape.

The load runs inside the doctor's window (its `sleep`), so the two scrapes bracket it exactly.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.cli import main as pagoda_main
from pagoda.diagnosis import Finding
from pagoda.ops.doctor import DoctorOptions, DoctorReport, run_doctor
from pagoda.ops.doctor_report import render_markdown, render_text
from pagoda.serve.admission.tenants import TenantRegistry
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("doctor") / "model")


@pytest.fixture
def serve(model_dir: Path) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def start(**kwargs: Any) -> LiveServer:
        started.append(start_server(model_dir, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def complete(
    server: LiveServer, prompt: str, *, max_tokens: int = 16, key: str | None = None, **body: Any
) -> httpx.Response:
    return httpx.post(
        server.base_url + "/completions",
        timeout=120,
        trust_env=False,
        headers={"Authorization": f"Bearer {key}"} if key else {},
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **body,
        },
    )


def concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def doctor(server: LiveServer, during: Callable[[], Any] = lambda: None, **options: Any) -> DoctorReport:
    """The doctor with `during` run as its window."""
    return run_doctor(DoctorOptions(url=server.url, window_s=0, **options), sleep=lambda _: during())


def by_id(report: DoctorReport) -> dict[str, Finding]:
    return {finding.id: finding for finding in report.findings}


def test_healthy_idle_server_has_nothing_above_info(serve: Callable[..., LiveServer]) -> None:
    server = serve()
    complete(server, "warm up")
    report = doctor(server, lambda: time.sleep(0.2))
    assert all(f.severity == "info" for f in report.findings), render_text(report)
    assert report.exit_code == 0
    assert "output_check" in by_id(report)  # the pointer to pagoda gate
    assert "pagoda gate" in render_markdown(report)

    code_and_output = []
    for flags in (["--json"], []):
        # The CLI: exit code by the worst severity, and the JSON report's shape.
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = pagoda_main(["doctor", server.url, "--window", "0.1", *flags])
        code_and_output.append((code, out.getvalue()))
    (json_code, json_text), (text_code, text) = code_and_output
    assert json_code == text_code == 0
    payload = json.loads(json_text)
    assert set(payload) >= {
        "url",
        "window_s",
        "model",
        "health",
        "worst_severity",
        "exit_code",
        "findings",
        "observations",
    }
    assert payload["model"] == MODEL_NAME and payload["health"]["status"] == "ok"
    assert payload["worst_severity"] == "info" and payload["exit_code"] == 0
    assert {"id", "severity", "title", "evidence", "next_checks"} <= set(payload["findings"][0])
    assert "[info] output_check" in text


def test_tiny_kv_pool_shows_preemptions(serve: Callable[..., LiveServer]) -> None:
    server = serve(engine={"num_kv_blocks": 12, "max_num_seqs": 8})
    snapshot = lambda: httpx.get(server.url + "/dashboard/snapshot", trust_env=False).json()  # noqa: E731
    assert snapshot()["diagnosis"] == []  # one sample: no window yet
    started = time.monotonic()
    report = doctor(
        server,
        lambda: concurrently([lambda i=i: complete(server, f"{i} " + WORDS * 2, max_tokens=40) for i in range(6)]),
    )
    # The dashboard's panel runs the same rules over its own window.
    time.sleep(max(0.0, started + 1.0 - time.monotonic()))
    panel = {finding["id"]: finding for finding in snapshot()["diagnosis"]}
    assert panel["preemptions"]["severity"] in ("warning", "critical")
    finding = by_id(report)["preemptions"]
    assert finding.severity in ("warning", "critical")
    assert sum(finding.evidence["preemptions_by_mode"].values()) > 0
    assert report.exit_code >= 1
    assert any("pagoda plan" in check for check in finding.next_checks)


def test_one_sequence_under_load_shows_the_queue(serve: Callable[..., LiveServer]) -> None:
    server = serve(engine={"max_num_seqs": 1})
    done: list[int] = []

    def load() -> None:
        def one(i: int) -> None:
            # Long enough that the queued requests wait well past the rule's noticeable queue.
            complete(server, f"{i} {WORDS}", max_tokens=96)
            done.append(i)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        # The second scrape happens while the batch is still full and requests wait.
        deadline = time.monotonic() + 120
        while len(done) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # ...and at a moment the batch is full: between two requests the running count is 0
        # for an instant, which a loaded machine can stretch into the scrape.
        while time.monotonic() < deadline:
            stats = server.stats()
            if stats is not None and stats.num_running == 1 and stats.num_waiting >= 1:
                break
            time.sleep(0.002)
        server.app.state.load_threads = threads

    report = doctor(server, load)
    for thread in server.app.state.load_threads:
        thread.join(120)
    finding = by_id(report)["queue_wait"]
    assert finding.severity == "warning" and "batch is full" in finding.title
    assert finding.evidence["max_num_seqs"] == 1
    assert finding.evidence["queue_share_of_ttft"] >= 0.5


def test_ngram_speculation_on_random_weights_shows_no_gain(serve: Callable[..., LiveServer]) -> None:
    server = serve(engine={"speculative": "ngram"})
    # A prompt of many distinct token ids: sampled tokens often match one of them, so the n-gram
    # proposer drafts its continuation, which a random model's samples then reject.
    prompt = [5 + j * 7 % 3000 for j in range(420)]
    report = doctor(
        server,
        lambda: concurrently(
            [lambda i=i: complete(server, prompt, max_tokens=64, temperature=1.0, seed=i) for i in range(8)]
        ),
    )
    finding = by_id(report)["speculation_no_gain"]
    assert finding.evidence["acceptance_rate"] < 0.3
    assert finding.evidence["draft_tokens"] >= 32


def test_two_tenants_show_prefix_cache_salt(serve: Callable[..., LiveServer], tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        textwrap.dedent("""\
        tenants:
          alice: {api_keys: [key-alice]}
          bob: {api_keys: [key-bob]}
    """)
    )
    server = serve(tenants=TenantRegistry.from_file(keys))
    shared = "You are a helpful assistant for the ACME company. " * 6

    def load() -> None:
        for i in range(3):
            for key in ("key-alice", "key-bob"):
                complete(server, shared + f"question {i} from {key}", max_tokens=4, key=key)

    report = doctor(server, load, probe=True, api_keys=["key-alice", "key-bob"])
    finding = by_id(report)["prefix_cache_tenant_salt"]
    assert finding.evidence["probe_cached_same_key"] > 0
    assert finding.evidence["probe_cached_second_key"] == 0
    assert "probe_failed" not in by_id(report)


def test_a_stopped_replica_is_critical(serve: Callable[..., LiveServer]) -> None:
    server = serve(deployment={"data_parallel_size": 2})
    server.llm.replicas[1].llm.shutdown()
    report = doctor(server)
    finding = by_id(report)["dead_replica"]
    assert finding.severity == "critical" and report.exit_code == 2
    assert [d["replica"] for d in finding.evidence["down"]] == [server.llm.replicas[1].label]
    assert pagoda_main(["doctor", server.url, "--window", "0"]) == 2
