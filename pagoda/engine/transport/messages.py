"""What crosses between the front and the engine side. Picklable: the process transport sends
them through a pipe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

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


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


ToEngine = Union[AddRequest, AbortRequests, Shutdown]

# The engine accepted an AddRequest.
ACCEPTED = "accepted"

# What the engine side emits after each step, per request id: ACCEPTED, the exception that
# refused an add, or a RequestOutputDelta.
EmittedItem = Union[str, BaseException, RequestOutputDelta]
Emitted = list[tuple[str, EmittedItem]]
