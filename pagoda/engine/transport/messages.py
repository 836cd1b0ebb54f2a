"""What the front sends the engine side. The thread transport hands them over as they are; the
process transport encodes them as JSON (encoding.py; never unpickled), a Ray actor's transport
lets Ray serialize them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.roles import HandoffTarget
from pagoda.lora_request import LoRARequest


@dataclass
class AddRequest:
    request: EngineRequest  # as the front built it
    # Disaggregation: a prefill engine hands the request off here once it has its first token;
    # a decode engine with awaiting_kv holds it until its KV arrives (or PrefillLocally).
    handoff: HandoffTarget | None = None
    awaiting_kv: bool = False


@dataclass
class PrefillLocally:
    """A decode engine stops awaiting these requests' KV and prefills them itself (the router
    saw their prefill engine fail or time out)."""

    request_ids: list[str]


@dataclass
class Wake:
    """Posted by the engine's own KV handoff threads: something arrived or was sent."""


@dataclass
class UpdateLoRA:
    """Load (`lora_request` with a path) or unload (`unload=True`) an adapter at run time.
    Answered like an AddRequest under `control_id`: accepted, or refused with the reason."""

    control_id: str
    lora_request: LoRARequest
    unload: bool = False


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


# ---- engine commands (weight updates, pause, sleep: engine/commands.py) ----------------------


@dataclass
class EngineCommand:
    """One of engine/commands.py's commands with its JSON-able arguments; answered like an
    AddRequest under `control_id`: accepted, or refused with the reason."""

    control_id: str
    command: str
    args: dict[str, Any] = field(default_factory=dict)


ToEngine = AddRequest | AbortRequests | UpdateLoRA | PrefillLocally | Wake | Shutdown | EngineCommand
