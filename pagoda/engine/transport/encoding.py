"""The front's messages to an engine process as bytes: one JSON object per message, its kind
under "kind" and its fields beside it. An explicit encoding, so that the engine process never
unpickles what it is sent; a request travels as EngineRequest.to_dict describes it.

(What the engine sends back, step outputs and stats, still crosses the pipe pickled: the engine
process is the server's own child, and those objects have no JSON form yet.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.transport.messages import (AbortRequests, AddRequest, EngineCommand, PrefillLocally, Shutdown,
                                              ToEngine, UpdateLoRA, Wake)
from pagoda.lora_request import LoRARequest

_KINDS: dict[str, type] = {"add": AddRequest, "abort": AbortRequests, "update_lora": UpdateLoRA,
                           "prefill_locally": PrefillLocally, "wake": Wake, "shutdown": Shutdown,
                           # engine commands: their arguments are JSON values already (the plain-field branch)
                           "command": EngineCommand}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def encode_message(message: ToEngine) -> bytes:
    data: dict[str, Any] = {"kind": _KIND_OF[type(message)]}
    if isinstance(message, AddRequest):
        data.update(request=message.request.to_dict(), awaiting_kv=message.awaiting_kv,
                    handoff=dataclasses.asdict(message.handoff) if message.handoff is not None else None)
    elif isinstance(message, UpdateLoRA):
        data.update(control_id=message.control_id, lora_request=dataclasses.asdict(message.lora_request),
                    unload=message.unload)
    else:  # fields of plain values
        data.update(dataclasses.asdict(message))
    return json.dumps(data).encode()


def decode_message(payload: bytes) -> ToEngine:
    data = json.loads(payload)
    cls = _KINDS[data.pop("kind")]
    if cls is AddRequest:
        handoff = data["handoff"]
        return AddRequest(EngineRequest.from_dict(data["request"]),
                          HandoffTarget(**handoff) if handoff is not None else None, data["awaiting_kv"])
    if cls is UpdateLoRA:
        return UpdateLoRA(data["control_id"], LoRARequest(**data["lora_request"]), data["unload"])
    return cls(**data)
