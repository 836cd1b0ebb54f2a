"""`pagoda bench serve`: workloads with exact token counts, and the load generator end to end
against a minimal streaming OpenAI-compatible stub server on 127.0.0.1 (defined here)."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench.lengths import LengthDist, fixed, lognormal, parse_length
from pagoda.bench.loadgen import arrival_intervals
from pagoda.bench.prompts import PromptBuilder
from pagoda.bench.report import parse_slo
from pagoda.bench.server_metrics import metrics_delta, parse_prometheus_text
from pagoda.bench.workloads import RAG_QUESTION_MARK, Workload, WorkloadSpec, load_tokenizer, parse_mix, parse_params
from pagoda.cli import bench as bench_cli


# ---- a streaming OpenAI-compatible stub ------------------------------------------------------
@dataclass
class StubState:
    token_delay: float = 0.002
    bodies: list[dict[str, Any]] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    queue_times: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def metrics_text(self) -> str:
        with self.lock:
            bounds = (0.001, 0.01, 0.1, 1.0)
            buckets = "".join(
                f'pagoda:request_queue_time_seconds_bucket{{le="{b}",model_name="stub"}} '
                f"{sum(t <= b for t in self.queue_times)}\n"
                for b in bounds
            )
            return (
                "# TYPE pagoda:prefix_cache_queries_total counter\n"
                f'pagoda:prefix_cache_queries_total{{model_name="stub"}} {self.prefix_queries}\n'
                f'pagoda:prefix_cache_hits_total{{model_name="stub"}} {self.prefix_hits}\n'
                f'pagoda:num_preemptions_total{{model_name="stub"}} {len(self.bodies) // 10}\n'
                f"{buckets}"
                f'pagoda:request_queue_time_seconds_bucket{{le="+Inf",model_name="stub"}} {len(self.queue_times)}\n'
                f'pagoda:request_queue_time_seconds_count{{model_name="stub"}} {len(self.queue_times)}\n'
                f'pagoda:request_queue_time_seconds_sum{{model_name="stub"}} {sum(self.queue_times)}\n'
            )


def make_handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, payload: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, state.metrics_text().encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"error": {"message": "not found"}}', "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, b'{"error": {"message": "no such route"}}', "application/json")
                return
            if body.get("fail"):
                self._send(400, b'{"error": {"message": "asked to fail", "code": 400}}', "application/json")
                return
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            with state.lock:
                state.bodies.append(body)
                state.prefix_queries += len(prompt)
                state.prefix_hits += len(prompt) // 2
                state.queue_times.append(0.005)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = int(body.get("max_tokens") or 16)
            for i in range(n):
                time.sleep(state.token_delay)
                choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


class StubServer:
    """Context manager: `with StubServer() as stub: stub.url`."""

    def __init__(self, token_delay: float = 0.002) -> None:
        self.state = StubState(token_delay=token_delay)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(self.state))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ---- fixtures ------------------------------------------------------------------------------


def train_tiny_tokenizer(out_dir: Path) -> Path:
    """A 1k byte-level BPE trained on a few stdlib modules (well under a second)."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in (stdlib / "json").glob("*.py")) + [str(stdlib / "argparse.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        files,
        trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def builder(tokenizer_dir: Path) -> PromptBuilder:
    return PromptBuilder.from_tokenizer(load_tokenizer(str(tokenizer_dir)))


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagoda")
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


SMALL = ["--length-scale", "0.02", "--max-model-len", "256", "--no-progress"]
ALL_CLASSES = "chat=0.3,rag=0.3,summarize=0.1,agent=0.3"


# ---- workloads -----------------------------------------------------------------------------


def test_every_class_has_exact_token_counts(builder: PromptBuilder, tmp_path: Path) -> None:
    jsonl = tmp_path / "traffic.jsonl"
    jsonl.write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {"prompt": "def main():\n    return 1", "output_len": 7, "class": "code"},
                {"prompt_len": 40, "output_len": 5},
                {"messages": [{"role": "user", "content": "hello there"}]},
            ]
        )
    )
    spec = WorkloadSpec(mix=parse_mix(f"{ALL_CLASSES},file:{jsonl}=0.2"), length_scale=0.05, max_model_len=512, seed=3)
    requests = Workload(spec, builder).build(80)
    assert {r.class_name for r in requests} == {"chat", "rag", "summarize", "agent", "code", "traffic"}
    for r in requests:
        assert builder.count(r.prompt) == r.prompt_len
        assert r.prompt_len + r.output_len <= 512 and r.output_len >= 1
    assert next(r for r in requests if r.class_name == "code").output_len == 7
    assert any(r.class_name == "traffic" and r.prompt_len == 40 for r in requests)

    rag = [r for r in requests if r.class_name == "rag"]
    docs = {r.prompt.split(RAG_QUESTION_MARK)[0] for r in rag}
    assert 1 <= len(docs) <= 4 < len(rag)  # a few shared documents, many questions

    by_index = {r.index: r for r in requests}
    turns = [r for r in requests if r.class_name == "agent" and r.depends_on is not None]
    assert turns, "agent sessions should have follow-up turns"
    for r in turns:
        previous = by_index[r.depends_on]
        assert r.session == previous.session and r.prompt.startswith(previous.prompt)
        assert r.prompt_len > previous.prompt_len + previous.output_len
        assert r.messages[-1]["role"] == "user" and r.messages[-2]["role"] == "assistant"

    again = Workload(spec, builder).build(80)
    assert [r.prompt for r in again] == [r.prompt for r in requests]  # seeded


def test_length_distributions_and_specs() -> None:
    rng = random.Random(0)
    samples = sorted(lognormal(200, 1000).sample(rng) for _ in range(4000))
    assert 180 <= samples[2000] <= 220 and 850 <= samples[3800] <= 1180
    assert parse_length("64") == fixed(64)
    assert parse_length("uniform:8:16").sample(rng) in range(8, 17)
    assert str(parse_length("lognormal:200:1000").scaled(0.1)) == "lognormal:20:100"
    for bad in ("uniform:9:3", "lognormal:5", "gamma:1:2", "x"):
        with pytest.raises(ValueError, match="bad length"):
            parse_length(bad)
    with pytest.raises(ValueError, match="unknown request class"):
        parse_mix("chat=1,videos=2")
    with pytest.raises(ValueError, match="has fields"):
        parse_params(["rag.turns=3"])
    assert parse_params(["agent.turns=uniform:2:3"])["agent"]["turns"] == LengthDist("uniform", 2, 3)


def test_arrivals_and_slo_and_metrics_parsing() -> None:
    gaps = list(itertools.islice(arrival_intervals(50.0, 0.5, seed=1), 4000))
    assert abs(sum(gaps) / len(gaps) - 0.02) < 0.002  # mean 1/rate at any burstiness
    assert parse_slo("ttft=0.5,itl=50ms") == {"ttft": 0.5, "itl": 0.05}
    with pytest.raises(ValueError, match="bad --slo"):
        parse_slo("latency=1")
    text_before = 'vllm:prefix_cache_queries_total{m="a"} 100\nvllm:prefix_cache_hits_total{m="a"} 10\n'
    text_after = (
        '# HELP x\nvllm:prefix_cache_queries_total{m="a"} 300\nvllm:prefix_cache_hits_total{m="a"} 160\n'
        "vllm:num_preemptions_total 2\n"
        'vllm:request_queue_time_seconds_bucket{le="0.1"} 50\n'
        'vllm:request_queue_time_seconds_bucket{le="1.0"} 100\n'
        'vllm:request_queue_time_seconds_bucket{le="+Inf"} 100\n'
        "vllm:request_queue_time_seconds_count 100\nvllm:request_queue_time_seconds_sum 20\n"
    )
    delta = metrics_delta(parse_prometheus_text(text_before), parse_prometheus_text(text_after))
    assert delta is not None and delta.source == "vllm:"
    assert delta.prefix_cache_hit_rate == pytest.approx(150 / 200)
    assert delta.num_preemptions == 2 and delta.queue_time_mean == pytest.approx(0.2)
    assert delta.queue_time_p50 == pytest.approx(0.1) and delta.queue_time_p99 == pytest.approx(0.982)
    assert metrics_delta({}, parse_prometheus_text("process_cpu_seconds_total 1\n")) is None


# ---- the load generator against the stub ---------------------------------------------------


def test_closed_loop_every_class_writes_json_and_plots(
    stub: StubServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = bench(
        [
            "serve",
            "--base-url",
            stub.url + "/v1",
            "--model",
            "stub",
            "--tokenizer",
            str(tokenizer_dir),
            "--mix",
            ALL_CLASSES,
            "--concurrency",
            "4",
            "--num-requests",
            "24",
            "--ignore-eos",
            "--warmup",
            "1",
            "--out",
            str(out),
            *SMALL,
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "TTFT" in printed and "prefix cache hit rate" in printed and "preemptions" in printed
    result = json.loads((out / "results.json").read_text())
    assert len(result["requests"]) == 24 and all(r["status"] == 200 for r in result["requests"])
    summary = result["summary"]
    assert summary["overall"]["num_ok"] == 24 and summary["concurrency"] == 4
    assert {c["name"] for c in summary["per_class"]} == {"chat", "rag", "summarize", "agent"}
    assert summary["server"]["prefix_cache_hit_rate"] == pytest.approx(0.5, abs=0.05)
    assert summary["server"]["queue_time_mean"] == pytest.approx(0.005)
    for r in result["requests"]:
        assert r["output_tokens"] == r["output_len"] and len(r["itls"]) == r["output_len"] - 1
    assert all(b.get("ignore_eos") is True for b in stub.state.bodies)
    assert len(stub.state.bodies) == 25  # 24 + the warmup request
    for png in ("latency_cdf.png", "over_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_loop_chat_endpoint_with_slo(
    stub: StubServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    rc = bench(
        [
            "serve",
            "--base-url",
            stub.url,
            "--model",
            "stub",
            "--tokenizer",
            str(tokenizer_dir),
            "--endpoint",
            "chat",
            "--mix",
            ALL_CLASSES,
            "--request-rate",
            "100",
            "--burstiness",
            "0.5",
            "--num-requests",
            "20",
            "--duration",
            "20",
            "--slo",
            "ttft=1,itl=0.5",
            "--out",
            str(out),
            *SMALL,
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0 and "goodput" in printed
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["overall"]["num_good"] == 20 and summary["request_rate"] == 100
    assert all("messages" in b and "prompt" not in b for b in stub.state.bodies)
    agent_turns = [b for b in stub.state.bodies if len(b["messages"]) > 1]
    assert agent_turns and all(b["messages"][-2]["role"] == "assistant" for b in agent_turns)


def test_duration_only_and_errors_by_status(
    stub: StubServer, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = bench(
        [
            "serve",
            "--base-url",
            stub.url,
            "--model",
            "stub",
            "--tokenizer",
            str(tokenizer_dir),
            "--request-rate",
            "40",
            "--duration",
            "0.5",
            "--extra-body",
            '{"fail": true}',
            *SMALL,
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 1
    assert "400: asked to fail" in printed
    ok, sent = map(int, re.search(r"(\d+)/(\d+) ok in", printed).groups())
    assert ok == 0 and 5 <= sent <= 60  # ~20 at 40/s for 0.5 s


def test_concurrency_sweep_plots(
    stub: StubServer, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    rc = bench(
        [
            "serve",
            "--base-url",
            stub.url,
            "--model",
            "stub",
            "--tokenizer",
            str(tokenizer_dir),
            "--mix",
            "chat",
            "--sweep-concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--out",
            str(out),
            *SMALL,
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "concurrency" in printed and "E2E p99 ms" in printed
    result = json.loads((out / "results.json").read_text())
    assert [p["concurrency"] for p in result["sweep"]] == [1, 4]
    assert all(p["num_ok"] == 8 for p in result["sweep"])
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_user_errors(tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        bench(
            [
                "serve",
                "--base-url",
                "http://127.0.0.1:9",
                "--model",
                "m",
                "--tokenizer",
                str(tokenizer_dir),
                "--mix",
                "chat=1,nope=2",
            ]
        )
        == 2
    )
    assert "unknown request class" in capsys.readouterr().err
    assert (
        bench(
            [
                "serve",
                "--base-url",
                "http://127.0.0.1:9",
                "--model",
                "m",
                "--tokenizer",
                str(tokenizer_dir),
                "--slo",
                "ttft",
            ]
        )
        == 2
    )
    assert "bad --slo" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama2-spm", "llama3-bpe", "qwen2-bpe"])
def test_prompt_builder_on_real_tokenizer_families(name: str) -> None:
    """SentencePiece (leading space as "▁", dropped by a lone decode) and byte-level BPE alike."""
    from tokenizer_fixtures import tokenizer_dir

    builder = PromptBuilder.from_tokenizer(load_tokenizer(str(tokenizer_dir(name))))
    assert len(builder.words) > 1000
    spec = WorkloadSpec(mix=parse_mix(ALL_CLASSES), length_scale=0.05, max_model_len=1024, seed=5)
    requests = Workload(spec, builder).build(24)
    for r in requests:
        assert builder.count(r.prompt) == r.prompt_len
    rng = random.Random(0)
    for target in (1, 2, 17, 300):
        assert builder.count(builder.extend_to("", target, rng)) == target
