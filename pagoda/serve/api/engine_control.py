"""Weight updates, pause and sleep on the HTTP side (admin keys only where keys are configured),
in the shapes RL frameworks call: SGLang's `POST /update_weights_from_disk {"model_path": DIR}`
and `/update_weights_from_distributed`, vLLM's weight-update phases (`/init_weight_update_group`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`,
`/destroy_weight_update_group`), `/pause?mode=wait|keep|abort`, `/resume`, `/sleep?level=1|2`,
`/wake_up` and `GET /is_sleeping`. Each answers `{"success": bool, "message": str}` as SGLang's
do: 200 when applied, 400 with the reason when refused (the old weights keep serving), 503 when
the engine is not running. They act on the primary model (every replica of it, or none).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pagoda.engine.client import EngineClient, EngineDeadError
from pagoda.errors import InvalidRequest


class UpdateWeightsFromDiskRequest(BaseModel):
    model_path: str
    load_format: str | None = None  # SGLang's; safetensors directories only
    abort_all_requests: bool = False  # SGLang's: abort what is in flight first (else it finishes on the new weights)


class InitWeightUpdateGroupRequest(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    backend: str = "gloo"
    group_name: str | None = None  # SGLang's; one group per engine here
    timeout_s: float = 120.0


class UpdateWeightsRequest(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str | None = None


class FinishWeightUpdateRequest(BaseModel):
    abort: bool = False


class EmptyRequest(BaseModel):
    pass


PAUSE_MODES = ("wait", "keep", "abort")


async def run_command(
    llm: EngineClient, command: str, args: dict[str, Any] | None = None, done: str = ""
) -> JSONResponse:
    """The command's answer in SGLang's shape."""
    started = time.perf_counter()
    try:
        await llm.engine_command(command, args or {})
    except InvalidRequest as error:
        return JSONResponse({"success": False, "message": str(error)}, status_code=400)
    except EngineDeadError as error:
        return JSONResponse({"success": False, "message": f"the engine is not running: {error}"}, status_code=503)
    return JSONResponse(
        {"success": True, "message": done or f"{command} done", "seconds": round(time.perf_counter() - started, 3)}
    )


async def update_weights_from_disk(llm: EngineClient, body: UpdateWeightsFromDiskRequest) -> JSONResponse:
    if body.load_format not in (None, "auto", "safetensors"):
        return JSONResponse(
            {
                "success": False,
                "message": f"load_format {body.load_format!r}: pagoda updates weights from safetensors directories",
            },
            status_code=400,
        )
    if body.abort_all_requests:
        response = await run_command(llm, "pause", {"mode": "abort"})
        if response.status_code != 200:
            return response
        try:
            return await run_command(
                llm,
                "update_weights_from_disk",
                {"model_path": body.model_path},
                f"weights updated from {body.model_path}",
            )
        finally:
            await run_command(llm, "resume")
    return await run_command(
        llm, "update_weights_from_disk", {"model_path": body.model_path}, f"weights updated from {body.model_path}"
    )


async def update_weights_from_distributed(llm: EngineClient, body: UpdateWeightsRequest) -> JSONResponse:
    """SGLang's one call: start, receive the broadcasts, commit (or drop them on a refusal)."""
    response = await run_command(llm, "start_weight_update")
    if response.status_code != 200:
        return response
    args = {"names": body.names, "dtypes": body.dtypes, "shapes": body.shapes}
    response = await run_command(llm, "update_weights", args)
    if response.status_code != 200:
        await run_command(llm, "finish_weight_update", {"abort": True})
        return response
    return await run_command(llm, "finish_weight_update", {}, f"{len(body.names)} tensors updated")
