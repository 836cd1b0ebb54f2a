"""What crosses between the front and the engine side. Picklable: the process transport sends
them through a pipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutputDelta
from pagoda.sampling_params import SamplingParams


@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None
    cache_salt: str | None
    priority: int
    lora_request: LoRARequest | None = None


@dataclass
class UpdateLoRA:
    """Load (`lora_request` with a path) or unload (`unload=True`) an adapter at run time.
    Answered like an AddRequest under `control_id`: ACCEPTED or the InvalidRequest refusing it."""

    control_id: str
    lora_request: LoRARequest
    unload: bool = False


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


ToEngine = Union[AddRequest, AbortRequests, UpdateLoRA, Shutdown]

# The engine accepted an AddRequest.
ACCEPTED = "accepted"

# What the engine side emits after each step, per request id: ACCEPTED, the exception that
# refused an add, or a RequestOutputDelta.
EmittedItem = Union[str, BaseException, RequestOutputDelta]
Emitted = list[tuple[str, EmittedItem]]
