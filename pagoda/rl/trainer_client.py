"""The trainer's side of a weight update, in vLLM's four phases over a pagoda server's admin
routes (admin keys only where keys are configured):

    client = WeightUpdateClient("http://127.0.0.1:8000", api_key=ADMIN_KEY)
    client.init_weight_update_group("127.0.0.1", 29555)          # init: both sides join the group
    client.update_weights(model.named_parameters())              # start, update (broadcast), finish
    client.destroy_weight_update_group()

`update_weights` runs start (the server stages an update), update (the names, dtypes and shapes
go over HTTP while the tensors follow as broadcasts from this rank) and finish (the server applies
the staged tensors all at once at a step boundary and answers success or the reason it kept the
old weights). The transfer is all of the model's tensors, as a checkpoint holds them.

A server that refuses the update phase before receiving leaves this side's broadcast waiting for
the group's timeout; the start phase checks what it can first (a group joined, the engine awake).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagoda.rl.weight_group import TRAINER_RANK, TensorMeta, WeightGroup, WeightGroupSpec, broadcast, join


class WeightUpdateError(RuntimeError):
    """The server answered success=false (the old weights still serve) or could not be reached."""


class WeightUpdateClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.group: WeightGroup | None = None
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="weight-update-http")

    # ---- the four phases --------------------------------------------------------------------

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int = 2,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        """Host the group (this process is rank 0) while the server's engines join it: one engine
        per rank from 1 (a server with several replicas needs world_size = 1 + replicas)."""
        spec = WeightGroupSpec(master_address, master_port, 1, world_size, backend, timeout_s)
        call = self._post_later(
            "/init_weight_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": 1,
                "world_size": world_size,
                "backend": backend,
                "timeout_s": timeout_s,
            },
        )
        self.group = join(spec, TRAINER_RANK)
        _answer(call.result())

    def start_weight_update(self) -> None:
        _answer(self._post("/start_weight_update", {}))

    def update_weights_phase(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Announce the tensors and broadcast them (the server stages them)."""
        if self.group is None:
            raise WeightUpdateError("init_weight_update_group first")
        metas = [TensorMeta.of(name, tensor) for name, tensor in named_tensors]
        call = self._post_later(
            "/update_weights",
            {
                "names": [m.name for m in metas],
                "dtypes": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas],
            },
        )
        broadcast(self.group, (tensor for _, tensor in named_tensors))
        _answer(call.result())

    def finish_weight_update(self, abort: bool = False) -> dict[str, Any]:
        """Apply what was staged (or, with abort, drop it); the server's answer."""
        return _answer(self._post("/finish_weight_update", {"abort": abort}))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """start, update and finish; WeightUpdateError with the server's reason on a refusal (the
        old weights keep serving)."""
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.start_weight_update()
        try:
            self.update_weights_phase(tensors)
        except WeightUpdateError:
            self._post("/finish_weight_update", {"abort": True})
            raise
        return self.finish_weight_update()

    def destroy_weight_update_group(self) -> None:
        _answer(self._post("/destroy_weight_update_group", {}))
        self.group = None

    # ---- other admin calls an RL loop makes -------------------------------------------------

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        return _answer(self._post("/update_weights_from_disk", {"model_path": model_path}))

    def pause(self, mode: str = "wait") -> dict[str, Any]:
        return _answer(self._post(f"/pause?mode={mode}", {}))

    def resume(self) -> dict[str, Any]:
        return _answer(self._post("/resume", {}))

    def close(self) -> None:
        self._calls.shutdown(wait=False)

    # ---- HTTP ---------------------------------------------------------------------------------

    def _post_later(self, path: str, body: dict[str, Any]) -> Future[dict[str, Any]]:
        return self._calls.submit(self._post, path, body)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                return json.loads(text) | {"success": False, "status": error.code}
            except ValueError:
                return {"success": False, "message": f"HTTP {error.code}: {text[:500]}"}
        except OSError as error:
            raise WeightUpdateError(f"{path}: {error}") from error


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    if not result.get("success", False):
        reason = result.get("message") or result.get("error", {}).get("message") or json.dumps(result)
        raise WeightUpdateError(str(reason))
    return result
