"""`pagoda bench canary-drill`: a canary whose candidate is deliberately regressed, under traffic.

The drill serves a model as `stable` and, as `candidate`, the same weights with a changed chat
template (every prompt line gets one more `#`: the regression a template edit slips into a
release). It starts `pagoda serve --models FILE` with a live canary over them, sends chat
traffic from the moment the server is up (the regression is live from then on), and reports
how long the canary took to roll back by itself and how many answers clients saw fail (5xx or
a transport error). Target: rollback within 30 s, zero client-visible errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagoda.config import DEFAULT_MODEL_DIR
from pagoda.http_client.server_process import free_port, running_server

TARGET_ROLLBACK_S = 30.0
PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""',
    "import os\nfor name in os.listdir('.'):",
    "class Stack:\n    def push(self, item):",
    "# read a file\nwith open(path) as f:",
)


@dataclass(frozen=True)
class DrillOptions:
    model: str | None = None  # default: the bundled model
    duration: float = 90.0  # the most seconds of traffic
    after_rollback: float = 5.0  # seconds of traffic kept up after the rollback
    concurrency: int = 4
    weight: float = 0.2
    shadow_sample: float = 0.5
    out: str = "benchmarks/results/canary_drill.json"
    startup_timeout: float = 300.0


def regressed_copy(model: Path, into: Path) -> Path:
    """`model`'s files linked into `into`, its chat template changed."""
    into.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        if path.name != "tokenizer_config.json":
            (into / path.name).symlink_to(path.resolve())
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if not isinstance(template, str) or "# " not in template:
        raise ValueError(f"{model}: the drill needs a chat template with a '# ' to change")
    config["chat_template"] = template.replace("# ", "## ")
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    return into


def models_file(stable: Path, candidate: Path, options: DrillOptions) -> str:
    return "\n".join(
        [
            "models:",
            f"  - {{name: stable, model: {json.dumps(str(stable))}}}",
            f"  - {{name: candidate, model: {json.dumps(str(candidate))}}}",
            "canary:",
            "  stable: stable",
            "  candidate: candidate",
            f"  weight: {options.weight}",
            "  window_s: 30",
            "  min_requests: 10",
            f"  shadow: {{sample: {options.shadow_sample}, max_tokens: 8}}",
            "  rules: {error_rate: 0.05, ttft_p99_ratio: 3, tokenization_mismatches: 0}",
            "",
        ]
    )


class Traffic:
    """Chat requests from `concurrency` threads until stopped; statuses counted by kind."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.url = url
        self.counts: dict[str, int] = {
            "ok": 0,
            "canary": 0,
            "client_errors": 0,
            "server_errors": 0,
            "transport_errors": 0,
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def _run(self, index: int) -> None:
        with httpx.Client(timeout=60, trust_env=False) as client:
            sent = index
            while not self._stop.is_set():
                prompt = PROMPTS[sent % len(PROMPTS)]
                sent += 1
                try:
                    answer = client.post(
                        f"{self.url}/v1/chat/completions",
                        json={
                            "model": "stable",
                            "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": 16,
                            "temperature": 0.7,
                        },
                    )
                except httpx.HTTPError:
                    self._count("transport_errors")
                    continue
                if answer.status_code >= 500:
                    self._count("server_errors")
                elif answer.status_code >= 400:
                    self._count("client_errors")
                else:
                    self._count("ok")
                    if answer.headers.get("x-pagoda-route", "").startswith("canary:"):
                        self._count("canary")


def run_drill(options: DrillOptions) -> dict[str, Any]:
    model = Path(options.model) if options.model else DEFAULT_MODEL_DIR
    with tempfile.TemporaryDirectory(prefix="canary-drill-") as scratch:
        root = Path(scratch)
        candidate = regressed_copy(model, root / "candidate")
        spec = root / "models.yaml"
        spec.write_text(models_file(model, candidate, options))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        command = [
            sys.executable,
            "-m",
            "pagoda.cli",
            "serve",
            "--models",
            str(spec),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        load_before = os.getloadavg()
        with running_server(
            command,
            f"{base}/health",
            timeout=options.startup_timeout,
            log_path=root / "server.log",
            name="the drill's server",
        ):
            traffic = Traffic(base, options.concurrency)
            regression_at = time.time()  # the candidate is regressed from its first request
            traffic.start()
            rolled_back_at = None
            status: dict[str, Any] = {}
            with httpx.Client(timeout=10, trust_env=False) as client:
                deadline = time.monotonic() + options.duration
                while time.monotonic() < deadline:
                    status = client.get(f"{base}/admin/canary").json()
                    if status["state"] == "rolled_back":
                        rolled_back_at = next(
                            e["at"] for e in reversed(status["events"]) if e["action"] == "rolled_back"
                        )
                        time.sleep(options.after_rollback)  # stable alone serves on
                        status = client.get(f"{base}/admin/canary").json()
                        break
                    time.sleep(0.2)
            traffic.stop()
    rollback_s = None if rolled_back_at is None else rolled_back_at - regression_at
    errors = traffic.counts["server_errors"] + traffic.counts["transport_errors"]
    return {
        "kind": "pagoda-canary-drill",
        "regression": "candidate chat template: '# ' -> '## ' per prompt line",
        "command": " ".join(["pagoda", "bench", "canary-drill", *sys.argv[3:]])
        if sys.argv[1:3] == ["bench", "canary-drill"]
        else "pagoda bench canary-drill",
        "commit": _commit(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "options": {
            "concurrency": options.concurrency,
            "weight": options.weight,
            "shadow_sample": options.shadow_sample,
            "duration": options.duration,
        },
        "rolled_back": rollback_s is not None,
        "time_to_rollback_s": rollback_s,
        "rollback_rule": next(
            (e["by"] for e in reversed(status.get("events", [])) if e["action"] == "rolled_back"), None
        ),
        "client_visible_errors": errors,
        "requests": traffic.counts,
        "candidate_loaded_after": status.get("loaded"),
        "passed": rollback_s is not None and rollback_s <= TARGET_ROLLBACK_S and errors == 0,
        "target": {"time_to_rollback_s": TARGET_ROLLBACK_S, "client_visible_errors": 0},
    }


def _commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.CalledProcessError):
        return None


def drill_main(options: DrillOptions) -> int:
    result = run_drill(options)
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    rollback = result["time_to_rollback_s"]
    outcome = (
        f"rolled back after {rollback:.1f} s ({result['rollback_rule']})" if rollback is not None else "no rollback"
    )
    requests = result["requests"]
    print(
        f"canary drill: {outcome}, {result['client_visible_errors']} client-visible errors of "
        f"{sum(requests.values())} requests ({requests['canary']} answered by the candidate) -> {out}"
    )
    return 0 if result["passed"] else 1
