"""What travels between the engine core and its workers, and how: typed messages, signed.

Every object that crosses a process boundary here (a worker's spec on its stdin or to its Ray
actor, the control messages rank 0 broadcasts, the steps passed down a pipeline's stages) is
encoded with msgspec into msgpack against a fixed type, and decoded against the same type:
what a peer sends can only ever become the fields of the expected dataclasses (ints, lists,
tensors of a few dtypes whose byte count matches their shape), never an object of a type the
sender chose. Nothing is unpickled: the peer engines that did (vLLM CVE-2025-47277, the same
pattern in SGLang and TensorRT-LLM) ran whatever a connection to their socket sent.

The control channel may cross machines (Ray places workers on other nodes, and rank 0's store
then listens on the node's address), so each message is signed: HMAC-SHA256 with a secret
rank 0 draws for its deployment and hands each worker in its spec. A message whose signature
does not verify, that does not decode to the expected type, or that claims to be larger than
MAX_MESSAGE_BYTES is rejected before anything is built from it, counted and logged
(`ChannelCodec.rejected`). The worker's spec itself travels on a private pipe (or Ray's own
channel) and is typed but not signed: it carries the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from typing import Any, Literal, TypeVar, get_args

import msgspec
import torch

logger = logging.getLogger(__name__)

SECRET_BYTES = 32
SIGNATURE_BYTES = hashlib.sha256().digest_size
# A step's StepInputs is a few MB at the largest batches (block tables); anything claiming more
# is not a control message, and its size is refused before a buffer is allocated for it.
MAX_MESSAGE_BYTES = 256 << 20

WireDType = Literal["int64", "int32", "int16", "int8", "uint8", "bool", "float32", "float16", "bfloat16", "float64"]
_DTYPES: dict[WireDType, torch.dtype] = {name: getattr(torch, name) for name in get_args(WireDType)}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

T = TypeVar("T")


class RejectedMessage(RuntimeError):
    """A message on an internal channel that was not signed with the deployment's secret, did not
    decode to the expected type, or was too large."""


class WireTensor(msgspec.Struct, forbid_unknown_fields=True):
    """A host tensor as it travels: dtype, shape and its bytes."""

    dtype: WireDType
    shape: list[int]
    data: bytes


def new_secret() -> bytes:
    """A deployment's channel secret."""
    return secrets.token_bytes(SECRET_BYTES)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().to("cpu").contiguous()
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"a {tensor.dtype} tensor cannot travel on the control channel")
        data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return WireTensor(_DTYPE_NAMES[tensor.dtype], list(tensor.shape), data)
    if isinstance(obj, torch.dtype):
        if obj not in _DTYPE_NAMES:
            raise TypeError(f"dtype {obj} cannot travel on the control channel")
        return _DTYPE_NAMES[obj]
    raise NotImplementedError(f"{type(obj).__name__} cannot travel on the control channel")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is torch.Tensor:
        wire = msgspec.convert(obj, WireTensor)
        if any(d < 0 for d in wire.shape):
            raise ValueError(f"tensor shape {wire.shape} has a negative dimension")
        dtype = _DTYPES[wire.dtype]
        numel = 1
        for d in wire.shape:
            numel *= d
        expected = numel * torch.empty(0, dtype=dtype).element_size()
        if expected != len(wire.data):
            raise ValueError(
                f"tensor of shape {wire.shape} ({wire.dtype}) needs {expected} bytes, "
                f"the message holds {len(wire.data)}"
            )
        if not numel:
            return torch.empty(wire.shape, dtype=dtype)
        return torch.frombuffer(bytearray(wire.data), dtype=torch.uint8).view(dtype).reshape(wire.shape)
    if kind is torch.dtype:
        name = msgspec.convert(obj, WireDType)
        return _DTYPES[name]
    raise NotImplementedError(f"{kind.__name__} does not travel on the control channel")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj: Any) -> bytes:
    """`obj` (a dataclass of the channel's types, or None) as msgpack."""
    return _ENCODER.encode(obj)


def decode(data: bytes | memoryview, kind: type[T]) -> T:
    """`data` as a `kind`; ValueError (naming what was wrong) for anything else."""
    try:
        return msgspec.msgpack.decode(data, type=kind, dec_hook=_dec_hook)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as error:
        raise ValueError(f"not a {getattr(kind, '__name__', kind)}: {error}") from None


class ChannelCodec:
    """Signs what this rank sends and verifies what it receives, with the deployment's secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"a channel secret has at least {SECRET_BYTES} bytes")
        self._secret = secret
        self.rejected = 0  # messages refused since start

    def seal(self, obj: Any) -> bytes:
        """The signed message: signature, then the msgpack body."""
        body = encode(obj)
        if len(body) + SIGNATURE_BYTES > MAX_MESSAGE_BYTES:
            raise ValueError(f"a control message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return hmac.new(self._secret, body, hashlib.sha256).digest() + body

    def check_size(self, size: int, sender: str) -> int:
        """The announced size of the next message, refused (before allocating) when no message is that large."""
        if not SIGNATURE_BYTES <= size <= MAX_MESSAGE_BYTES:
            self._reject(sender, f"announced size {size} bytes is outside [{SIGNATURE_BYTES}, {MAX_MESSAGE_BYTES}]")
        return size

    def open(self, sealed: bytes | memoryview, kind: Any, sender: str) -> Any:
        """The `kind` a signed message holds; RejectedMessage (counted and logged) otherwise."""
        view = memoryview(sealed)
        if len(view) < SIGNATURE_BYTES:
            self._reject(sender, f"{len(view)} bytes, shorter than a signature")
        signature, body = view[:SIGNATURE_BYTES], view[SIGNATURE_BYTES:]
        expected = hmac.new(self._secret, body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, bytes(signature)):
            self._reject(sender, "bad signature")
        try:
            return decode(body, kind)
        except ValueError as error:
            self._reject(sender, str(error))

    def _reject(self, sender: str, why: str) -> None:
        self.rejected += 1
        logger.error("control channel: rejected message %d from %s: %s", self.rejected, sender, why)
        raise RejectedMessage(f"rejected a control message from {sender}: {why}")
