"""The weight-update, pause and sleep admin routes on a live server: a trainer process streams
new weights over gloo (pagoda.rl.trainer_client) and greedy output then equals transformers on
them; a failed update answers success=false and keeps the old weights; sleep answers 503s."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_factory import build_model, hf_greedy, load_hf_model
from pagoda.serve.admission.tenants import Tenant, TenantRegistry
from server_utils import MODEL_NAME, REPO_ROOT, LiveServer, free_port, start_server

PROMPT = list(range(5, 45))
MAX_TOKENS = 8
ADMIN = {"Authorization": "Bearer key-admin"}
USER = {"Authorization": "Bearer key-user"}
TRAINER = textwrap.dedent("""
    import json, sys, urllib.request
    from safetensors.torch import load_file
    from pagoda.rl.trainer_client import WeightUpdateClient, WeightUpdateError
    url, port, model_dir, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    tensors = load_file(model_dir + "/model.safetensors")  # the trainer's parameters, by checkpoint name
    client = WeightUpdateClient(url, api_key="key-admin")
    client.init_weight_update_group("127.0.0.1", port)
    partial = [(name, t) for name, t in tensors.items() if not name.endswith("down_proj.weight")]
    try:
        client.update_weights(partial)
    except WeightUpdateError as error:
        print("REFUSED", error)
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json",
                                     "Authorization": "Bearer key-user"})
    print("BETWEEN", json.loads(urllib.request.urlopen(request).read())["choices"][0]["token_ids"])
    print("UPDATED", client.update_weights(tensors.items())["seconds"])
    client.destroy_weight_update_group()
""")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    return {"old": build_model(root / "old", "llama", seed=0), "new": build_model(root / "new", "llama", seed=1)}


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, Path]) -> dict[str, list[int]]:
    return {name: hf_greedy(load_hf_model(path), PROMPT, MAX_TOKENS)[0] for name, path in checkpoints.items()}


@pytest.fixture()
def server(checkpoints: dict[str, Path]) -> Any:
    tenants = TenantRegistry({"key-admin": Tenant("ops", admin=True), "key-user": Tenant("user")})
    live = start_server(checkpoints["old"], engine={"num_kv_blocks": 64}, tenants=tenants)
    yield live
    live.stop()


def greedy(server: LiveServer) -> httpx.Response:
    return httpx.post(
        server.base_url + "/completions",
        headers=USER,
        timeout=60,
        json={
            "model": MODEL_NAME,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )


def tokens(server: LiveServer) -> list[int]:
    response = greedy(server)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def admin(server: LiveServer, path: str, body: dict[str, Any] | None = None, key=ADMIN) -> httpx.Response:
    return httpx.post(server.url + path, headers=key, json=body if body is not None else {}, timeout=60)


def test_a_trainer_process_streams_new_weights_over_gloo(server: LiveServer, checkpoints, references) -> None:
    assert tokens(server) == references["old"]
    trainer = subprocess.run(
        [sys.executable, "-c", TRAINER, server.url, str(free_port()), str(checkpoints["new"]), json.dumps(PROMPT)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in trainer.stdout.splitlines())
    assert "checkpoint is missing tensor(s) model.layers.0.mlp.down_proj.weight" in lines["REFUSED"]
    assert json.loads(lines["BETWEEN"]) == references["old"]  # the refused update left the old weights serving
    assert tokens(server) == references["new"]


def test_update_from_disk_and_a_failed_one(server: LiveServer, checkpoints, references, tmp_path: Path) -> None:
    refused = admin(server, "/update_weights_from_disk", {"model_path": str(checkpoints["new"])}, key=USER)
    assert refused.status_code == 403
    failed = admin(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert failed.status_code == 400
    assert failed.json()["success"] is False and "safetensors" in failed.json()["message"]
    assert tokens(server) == references["old"]
    done = admin(server, "/update_weights_from_disk", {"model_path": str(checkpoints["new"])})
    assert done.status_code == 200 and done.json()["success"] is True
    assert tokens(server) == references["new"]


def test_sleep_answers_503_until_woken(server: LiveServer, references) -> None:
    assert admin(server, "/sleep?level=1").json()["success"] is True
    assert httpx.get(server.url + "/is_sleeping", headers=ADMIN).json() == {"is_sleeping": True, "level": 1}
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "asleep"
    asleep = greedy(server)
    assert asleep.status_code == 503 and asleep.json()["error"]["code"] == "model_asleep"
    assert admin(server, "/wake_up").json()["success"] is True
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert tokens(server) == references["old"]


def test_pause_holds_new_requests_until_resume(server: LiveServer, references) -> None:
    assert admin(server, "/pause?mode=bogus").status_code == 400
    assert admin(server, "/pause?mode=wait").json()["success"] is True
    result: list[httpx.Response] = []
    held = threading.Thread(target=lambda: result.append(greedy(server)))
    held.start()
    held.join(0.5)
    assert held.is_alive()  # held at the front while paused
    assert admin(server, "/resume").json()["success"] is True
    held.join(30)
    assert result and result[0].status_code == 200
