"""Everything that crosses the process transport's pipe, as bytes of an explicit encoding:
nothing on either side is unpickled, so whatever reaches the pipe can only become the fields
of the expected types (peer engines that unpickled their internal sockets ran any code sent
to them: vLLM CVE-2025-47277, the same pattern in SGLang and TensorRT-LLM).

- Front -> engine: one JSON object per message, its kind under "kind" and its fields beside
  it; a request travels as EngineRequest.to_dict describes it.
- Engine -> front: msgpack of a tagged message (Ready, Failed, Batch, Dead) decoded with
  msgspec against exactly those types: the step output's deltas (tokens, text, logprobs,
  prompt logprobs, finish reasons, metrics), its acceptances, refusals (an InvalidRequest's
  message, param and code, or a RuntimeError's message), handoff outcomes, and the engine's
  stats. Anything else is a ValueError, and the front treats the engine as dead.
- The engine's start: the EngineConfig as msgpack (decoded, and so validated, in the child),
  an engine factory as the "module:name" the child imports, and the parent's pid.

The pipe is private to the server and its spawned child (no listener, nothing another host
reaches), so its messages are typed but not signed; the channels that may cross machines
(executor/channel.py, the KV handoff) are signed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import msgspec

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineStats
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.max_num_seqs import MaxNumSeqsChoice
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.step_output import EngineStepOutput
from pagoda.engine.transport.base import EngineFactory, EngineInfo
from pagoda.engine.transport.messages import (
    AbortRequests,
    AddRequest,
    EngineCommand,
    PrefillLocally,
    Shutdown,
    ToEngine,
    UpdateLoRA,
    Wake,
)
from pagoda.engine.validation import EngineLimits
from pagoda.errors import InvalidRequest
from pagoda.lora_request import LoRARequest
from pagoda.model.classifier_config import ClassifierConfig

_KINDS: dict[str, type] = {
    "add": AddRequest,
    "abort": AbortRequests,
    "update_lora": UpdateLoRA,
    "prefill_locally": PrefillLocally,
    "wake": Wake,
    "shutdown": Shutdown,
    # engine commands: their arguments are JSON values already (the plain-field branch)
    "command": EngineCommand,
}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}


def encode_message(message: ToEngine) -> bytes:
    data: dict[str, Any] = {"kind": _KIND_OF[type(message)]}
    if isinstance(message, AddRequest):
        data.update(
            request=message.request.to_dict(),
            awaiting_kv=message.awaiting_kv,
            handoff=dataclasses.asdict(message.handoff) if message.handoff is not None else None,
        )
    elif isinstance(message, UpdateLoRA):
        data.update(
            control_id=message.control_id, lora_request=dataclasses.asdict(message.lora_request), unload=message.unload
        )
    else:  # fields of plain values
        data.update(dataclasses.asdict(message))
    return json.dumps(data).encode()


def decode_message(payload: bytes) -> ToEngine:
    """The front's message; ValueError (naming what was wrong) for anything else."""
    try:
        return _decode_message(payload)
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"not a message from the front: {type(error).__name__}: {error}") from None


def _decode_message(payload: bytes) -> ToEngine:
    data = json.loads(payload)
    cls = _KINDS[data.pop("kind")]
    if cls is AddRequest:
        handoff = data["handoff"]
        return AddRequest(
            EngineRequest.from_dict(data["request"]),
            HandoffTarget(**handoff) if handoff is not None else None,
            data["awaiting_kv"],
        )
    if cls is UpdateLoRA:
        return UpdateLoRA(data["control_id"], LoRARequest(**data["lora_request"]), data["unload"])
    return cls(**data)


# ---- what the engine sends back ------------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    """The engine is built: EngineInfo's fields."""

    max_model_len: int
    engine_limits: EngineLimits
    generation_defaults: dict[str, Any]
    classifier: ClassifierConfig | None
    stats: EngineStats
    max_num_seqs_choice: MaxNumSeqsChoice
    kv_pool_memory: str
    kv_address: str | None
    weights_digest: str | None

    @classmethod
    def of(cls, info: EngineInfo) -> Ready:
        return cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(EngineInfo)})

    def info(self) -> EngineInfo:
        return EngineInfo(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineInfo)})


class Failed(msgspec.Struct, tag="failed", forbid_unknown_fields=True):
    """The engine could not be built."""

    reason: str


class Batch(msgspec.Struct, tag="batch", forbid_unknown_fields=True):
    """One step's output and the engine's stats after it."""

    output: EngineStepOutput
    stats: EngineStats


class Dead(msgspec.Struct, tag="dead", forbid_unknown_fields=True):
    """The engine stopped (its loop raised, or a worker died)."""

    reason: str


FromEngine = Ready | Failed | Batch | Dead
# Errors in EngineStepOutput.refused travel as their kind and fields; these are the kinds.
_ERRORS: dict[str, type[BaseException]] = {"InvalidRequest": InvalidRequest, "RuntimeError": RuntimeError}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, InvalidRequest):
        return {"kind": "InvalidRequest", "message": obj.message, "param": obj.param, "code": obj.code}
    if isinstance(obj, BaseException):  # a refusal that is a bug for this request: its message
        return {"kind": "RuntimeError", "message": str(obj), "param": None, "code": None}
    raise NotImplementedError(f"{type(obj).__name__} does not travel from the engine process")


class _WireError(msgspec.Struct, forbid_unknown_fields=True):
    kind: str
    message: str
    param: str | None
    code: str | None


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is BaseException:
        error = msgspec.convert(obj, _WireError)
        if error.kind == "InvalidRequest":
            return InvalidRequest(error.message, param=error.param, code=error.code)
        if error.kind == "RuntimeError":
            return RuntimeError(error.message)
        raise ValueError(f"unknown error kind {error.kind!r}")
    raise NotImplementedError(f"{kind.__name__} does not travel from the engine process")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(FromEngine, dec_hook=_dec_hook)


def encode_reply(message: FromEngine) -> bytes:
    """What the engine process sends its front, as msgpack."""
    return _ENCODER.encode(message)


def decode_reply(payload: bytes) -> FromEngine:
    """The engine's message; ValueError (naming what was wrong) for anything else."""
    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as error:
        raise ValueError(f"not a message from the engine: {error}") from None


# ---- what the engine process is started with ---------------------------------------------------


def encode_config(config: EngineConfig) -> bytes:
    return msgspec.msgpack.encode(config)


def decode_config(payload: bytes) -> EngineConfig:
    try:
        return msgspec.msgpack.decode(payload, type=EngineConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ValueError(f"not an EngineConfig: {error}") from None


def factory_reference(factory: EngineFactory | None) -> str | None:
    """A module-level engine factory as "module:qualified.name": what crosses to the engine
    process in its place, which imports it (never unpickles it)."""
    if factory is None:
        return None
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or not name or "<" in name or resolve_factory(f"{module}:{name}") is not factory:
        raise ValueError(
            f"an engine factory for the process transport must be a module-level function or class, got {factory!r}"
        )
    return f"{module}:{name}"


def resolve_factory(reference: str | None) -> EngineFactory | None:
    if reference is None:
        return None
    module_name, _, name = reference.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in name.split("."):
        target = getattr(target, part)
    return target
