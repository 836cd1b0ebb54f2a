"""One EngineRequest from the front to the engine core: no signature in between names its
fields (so a new per-request field touches the struct and its consumer only), and the process
transport's explicit encoding carries every field unchanged."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import pytest
import torch

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.client import EngineClient, generate_outputs
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.transport.encoding import decode_message, encode_message
from pagoda.engine.transport.messages import (
    AbortRequests,
    AddRequest,
    EngineCommand,
    PrefillLocally,
    Shutdown,
    UpdateLoRA,
    Wake,
)
from pagoda.lora_request import LoRARequest
from pagoda.media_item import MediaItem
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.replicas.supervised_engine import SupervisedEngine
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

FIELDS = {f.name for f in dataclasses.fields(EngineRequest)}

# Every hop a request takes from the server's handler to the scheduler, in order.
PATH: list[Callable] = [
    EngineClient.add_request,
    EngineClient.generate,
    generate_outputs,
    ReplicaSet.add_request,
    ReplicaSet.generate,
    SupervisedEngine.add_request,
    SupervisedEngine.generate,
    AsyncLLM.add_request,
    AsyncLLM.generate,
    LLMEngine.add_request,
    EngineCore.add_request,
]


def every_field_set() -> EngineRequest:
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_k=5,
        logit_bias={7: 1.5},
        stop=["x"],
        seed=3,
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
        bad_words=["no"],
        max_tokens=9,
    )
    request = EngineRequest(
        "r1",
        [5, 6, 7],
        params,
        arrival_time=1234.5678901,
        cache_salt="salt",
        priority=-2,
        lora_request=LoRARequest("sql", 3, "/adapters/sql"),
        tenant="acme",
        model="sql",
        media=(MediaItem("ab12", 1, 2, torch.arange(12, dtype=torch.float32).reshape(3, 2, 2) / 7, (1, 2, 2)),),
    )
    defaults = EngineRequest("r1", [5, 6, 7], SamplingParams())
    unset = [
        name
        for name in FIELDS
        if getattr(request, name) == getattr(defaults, name) and name not in ("request_id", "prompt")
    ]
    assert not unset, f"set {unset} in this test, so that the encoding is checked for them"
    return request


@pytest.mark.parametrize("hop", PATH, ids=lambda hop: hop.__qualname__)
def test_no_hop_names_a_request_field(hop: Callable) -> None:
    parameters = inspect.signature(hop).parameters
    assert not FIELDS & set(parameters), f"{hop.__qualname__} takes request fields one by one"
    assert "request" in parameters


def test_the_message_carries_the_request_whole() -> None:
    assert not FIELDS & {f.name for f in dataclasses.fields(AddRequest)}


@pytest.mark.parametrize("prompt", [[5, 6, 7], "some text"])
def test_every_field_survives_the_process_encoding(prompt: str | list[int]) -> None:
    request = dataclasses.replace(every_field_set(), prompt=prompt)
    assert set(request.to_dict()) == FIELDS
    message = AddRequest(request, HandoffTarget("tcp", "127.0.0.1:9", "r1@decode", 2.5), awaiting_kv=True)
    decoded = decode_message(encode_message(message))
    assert decoded == message
    assert decoded.request.params.logit_bias == {7: 1.5}  # JSON keys come back as token ids
    assert isinstance(decoded.request.params.structured_outputs, StructuredOutputsParams)


@pytest.mark.parametrize(
    "message",
    [
        AddRequest(EngineRequest("r", [1], SamplingParams())),
        AbortRequests(["a", "b"]),
        UpdateLoRA("lora-update-1", LoRARequest("chat", 0, "/adapters/chat")),
        UpdateLoRA("lora-update-2", LoRARequest("chat"), unload=True),
        PrefillLocally(["c"]),
        Wake(),
        Shutdown(),
        EngineCommand("command-1", "update_weights", {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 3]]}),
        EngineCommand("command-2", "sleep", {"level": 2}),
    ],
)
def test_every_message_round_trips(message) -> None:
    assert decode_message(encode_message(message)) == message


def test_the_core_takes_token_ids_only() -> None:
    with pytest.raises(ValueError, match="tokenize the prompt first"):
        _ = EngineRequest("r", "text", SamplingParams()).prompt_token_ids
