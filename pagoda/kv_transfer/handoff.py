"""Moving one prefilled request's KV blocks from a prefill engine to a decode engine.

One small interface, two transports:

- `tcp`: the decode side listens on host:port; block bytes travel inside the socket's frames.
- `shm`: one host. The control frames travel on a Unix socket (its path is the address); the
  block bytes are written by the sender into a POSIX shared-memory segment and copied by the
  receiver out of it (they never pass through the socket).

The exchange, in length-prefixed frames (8-byte big-endian length, then the payload and its
signature):

    receiver -> its nonce (16 bytes, unframed), sender -> its nonce (16 bytes, unframed)
    sender   -> header (JSON: request, block hashes, block layout, the shm segment's name)
    receiver -> reply  (JSON: {"skip": k}: the leading blocks its own prefix cache holds, or
                        {"reject": reason})
    sender   -> blocks k..n-1 in order, in runs of consecutive blocks of at most CHUNK_BYTES
                (a frame: first index, count, then each cache tensor's bytes of those blocks;
                over shm the frame is a notice and the bytes are in the segment)
    sender   -> end frame
    receiver -> ack

The receiver allocates its blocks as soon as the header arrives and writes each run as it
comes, so its copy of one run overlaps the wire time of the next. Runs rather than single
blocks: a frame per block costs a syscall and a scatter per cache tensor (20 for a 10-layer
model) for a few KiB each, which dominated the transfer time (benchmarks/kv_transfer.py). Blocks are
the raw cache entries as stored: quantized KV (int8 / fp8 entries with their scales) travels
quantized. Every socket operation has a timeout; anything that goes wrong raises
TransferError on both sides.

Every frame is signed: HMAC-SHA256 under the deployment's KV transfer secret (HandoffAuth; the
prefill and decode engines of one deployment are handed the same one), over both nonces, the
frame's direction and its sequence number in that direction, and its payload (over shm, a run's
bytes in the segment too, as the receiver copied them out). A frame whose signature does not
verify is refused before anything is built from it: the handoff fails with FrameRejected, and
the refusal is counted (`HandoffAuth.rejected`) and logged. The nonces make each connection's
signatures its own, so frames recorded from one handoff cannot be replayed into another.
Nothing here is ever unpickled: the header and replies are JSON, the blocks raw bytes checked
against the header's layout.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.kv_transfer.shm_segments import SegmentMaps, ShmSegments

logger = logging.getLogger(__name__)

TRANSPORTS = ("tcp", "shm")
_LENGTH = struct.Struct(">Q")
_RUN = struct.Struct(">II")  # first block index, number of blocks
CHUNK_BYTES = 2 << 20  # a run of blocks per frame: large enough to amortize, small enough to overlap
_END = b"END"
MAX_HEADER_BYTES = 64 << 20  # a header larger than this is not a handoff header
NONCE_BYTES = 16
TAG_BYTES = hashlib.sha256().digest_size
TRANSFER_SECRET_ENV = "PAGODA_KV_TRANSFER_SECRET"  # engines started apart read the secret here
MIN_SECRET_CHARS = 32  # an operator's --kv-transfer-secret; a drawn one is 64 hex digits
_TO_RECEIVER, _TO_SENDER = b"R", b"S"  # a frame's direction, signed with it


class TransferError(RuntimeError):
    """A handoff that did not complete: connection dropped, timed out, or refused."""


class HandoffRefused(TransferError):
    """The receiver will not use the sender's KV (or first token) for this request: another
    model, block layout, tenant salt or adapter produced it."""


class TransportUnavailable(TransferError):
    """The transport asked for cannot run here (unknown name, no shared memory, no Unix sockets)."""


class FrameRejected(TransferError):
    """A frame not signed with the deployment's KV transfer secret (or replayed from another
    connection, or out of order)."""


def new_transfer_secret() -> str:
    """A deployment's KV transfer secret, drawn once and handed to its prefill and decode engines."""
    return secrets.token_hex(32)


class HandoffAuth:
    """Signs and verifies one engine's KV handoff frames with its deployment's secret, and counts
    the frames it refused (thread-safe: every handoff thread shares it)."""

    def __init__(self, secret: str) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"a KV transfer secret has at least {MIN_SECRET_CHARS} characters")
        self._secret = secret.encode()
        self._lock = threading.Lock()
        self.rejected = 0  # frames refused since start

    def session(self, receiver_nonce: bytes, sender_nonce: bytes, sending: bytes) -> FrameSession:
        """One connection's signer: `sending` is the direction of the frames this side sends."""
        return FrameSession(self, receiver_nonce + sender_nonce, sending)

    def tag(self, context: bytes, direction: bytes, sequence: int, parts: Sequence[bytes | memoryview]) -> bytes:
        mac = hmac.new(self._secret, context + direction + sequence.to_bytes(8, "big"), hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def reject(self, peer: str, why: str) -> FrameRejected:
        with self._lock:
            self.rejected += 1
            count = self.rejected
        logger.error("KV handoff: refused frame %d from %s: %s", count, peer, why)
        return FrameRejected(f"KV handoff frame from {peer} refused: {why}")


class FrameSession:
    """The signatures of one connection's frames: each direction numbers its frames from 0."""

    def __init__(self, auth: HandoffAuth, context: bytes, sending: bytes) -> None:
        self._auth = auth
        self._context = context
        self._sending = sending
        self._receiving = _TO_SENDER if sending == _TO_RECEIVER else _TO_RECEIVER
        self._sent = self._received = 0
        self.peer = "?"

    def sign(self, parts: Sequence[bytes | memoryview]) -> bytes:
        tag = self._auth.tag(self._context, self._sending, self._sent, parts)
        self._sent += 1
        return tag

    def verify(self, parts: Sequence[bytes | memoryview], tag: bytes | memoryview) -> None:
        """Raise FrameRejected (counted, logged) unless `tag` signs the next frame from the peer."""
        expected = self._auth.tag(self._context, self._receiving, self._received, parts)
        if not hmac.compare_digest(expected, bytes(tag)):
            raise self.reject("bad signature (another deployment's secret, or none)")
        self._received += 1

    def reject(self, why: str) -> FrameRejected:
        """Count and log a refused frame from the peer; the error to raise."""
        return self._auth.reject(self.peer, why)


@dataclass
class HandoffHeader:
    """Everything but the KV: what the decode side needs to continue the request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token, sampled by the prefill engine
    sampling_params: dict[str, Any]  # SamplingParams as a dict (engine layer rebuilds it)
    cache_salt: str | None
    lora_name: str | None
    block_size: int
    block_hashes: list[str]  # hex of the sender's chained hashes of the full prompt blocks
    num_blocks: int  # blocks holding the prompt's KV (the last may be partial)
    # Per cache tensor: (dtype name, shape of one block); both sides must agree exactly.
    layout: list[tuple[str, list[int]]]
    fingerprint: str  # model, dtype, block size and KV dtype (kv_transfer.tiers.model_fingerprint)
    # Prefill side's timings (seconds): queued before its first step, and the prefill itself.
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    shm_name: str | None = None  # shm transport: the segment holding the blocks
    # The first token's logprobs when the request asked for them: per position, [token id,
    # logprob, rank] of the sampled token and the top ones; and their running sum.
    output_logprobs: list[list[tuple[int, float, int]]] | None = None
    cumulative_logprob: float = 0.0
    # A seeded request's generator after the first token (base64 of torch's state), so the
    # decode side draws what one engine would have drawn next.
    generator_state: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> HandoffHeader:
        data = json.loads(payload)
        data["layout"] = [(dtype, list(shape)) for dtype, shape in data["layout"]]
        return cls(**data)

    @property
    def block_nbytes(self) -> int:
        return sum(_dtype(d).itemsize * _numel(shape) for d, shape in self.layout)


@dataclass
class KVHandoff:
    """An exported request: its header and a host copy of its blocks (one tensor per cache
    tensor, blocks first). The prefill engine's own blocks are already free."""

    header: HandoffHeader
    blocks: list[torch.Tensor] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks)


# ---- framing -----------------------------------------------------------------------------------


def _send_frame(
    sock: socket.socket,
    session: FrameSession,
    parts: Sequence[bytes | memoryview],
    signed_too: Sequence[bytes | memoryview] = (),
) -> None:
    """One signed frame of `parts`; `signed_too`: bytes the signature covers that travel
    elsewhere (over shm, the run in the segment)."""
    tag = session.sign([*parts, *signed_too])
    sock.sendall(_LENGTH.pack(sum(len(p) for p in parts) + TAG_BYTES))
    for part in parts:
        sock.sendall(part)
    sock.sendall(tag)


def _recv_exact(sock: socket.socket, size: int, into: memoryview | None = None) -> memoryview:
    buffer = into if into is not None else memoryview(bytearray(size))
    received = 0
    while received < size:
        try:
            n = sock.recv_into(buffer[received:size])
        except TimeoutError:
            raise TransferError("KV transfer timed out waiting for the peer") from None
        except OSError as error:
            raise TransferError(f"KV transfer connection failed: {error}") from None
        if n == 0:
            raise TransferError("KV transfer connection closed by the peer mid-transfer")
        received += n
    return buffer


def _recv_size(sock: socket.socket, limit: int, session: FrameSession) -> int:
    """The next frame's payload size (its signature excluded), refused (before allocating)
    when no frame here is that large."""
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if not TAG_BYTES <= size <= limit + TAG_BYTES:
        raise session.reject(f"a frame of {size} bytes is outside [{TAG_BYTES}, {limit + TAG_BYTES}]")
    return size - TAG_BYTES


def _recv_frame(sock: socket.socket, session: FrameSession, limit: int = MAX_HEADER_BYTES) -> memoryview:
    """The next frame's payload, its signature verified."""
    size = _recv_size(sock, limit, session)
    frame = _recv_exact(sock, size + TAG_BYTES)
    session.verify([frame[:size]], frame[size:])
    return frame[:size]


def _sendall(
    sock: socket.socket,
    session: FrameSession,
    *parts: bytes | memoryview,
    signed_too: Sequence[bytes | memoryview] = (),
) -> None:
    try:
        _send_frame(sock, session, parts, signed_too)
    except TimeoutError:
        raise TransferError("KV transfer timed out sending to the peer") from None
    except OSError as error:
        raise TransferError(f"KV transfer connection failed: {error}") from None


def _exchange_nonces(sock: socket.socket, auth: HandoffAuth, receiving_side: bool, peer: str) -> FrameSession:
    """Each side sends a fresh nonce, the receiver first; both sign with both."""
    mine = secrets.token_bytes(NONCE_BYTES)
    try:
        if receiving_side:
            sock.sendall(mine)
            theirs = bytes(_recv_exact(sock, NONCE_BYTES))
            session = auth.session(mine, theirs, _TO_SENDER)
        else:
            theirs = bytes(_recv_exact(sock, NONCE_BYTES))
            sock.sendall(mine)
            session = auth.session(theirs, mine, _TO_RECEIVER)
    except TimeoutError:
        raise TransferError("KV transfer timed out opening the connection") from None
    except OSError as error:
        raise TransferError(f"KV transfer connection failed: {error}") from None
    session.peer = peer
    return session


# ---- transports --------------------------------------------------------------------------------


def check_transport(transport: str) -> None:
    """Raise TransportUnavailable (with the reason) unless `transport` can run on this host."""
    if transport not in TRANSPORTS:
        raise TransportUnavailable(f"unknown KV transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if transport == "shm":
        if not hasattr(socket, "AF_UNIX"):
            raise TransportUnavailable("the shm KV transport needs Unix domain sockets, which this platform lacks")
        try:
            from multiprocessing import shared_memory  # noqa: F401
        except ImportError as error:
            raise TransportUnavailable(f"the shm KV transport needs POSIX shared memory: {error}") from None


def _connect(transport: str, address: str, timeout: float) -> socket.socket:
    check_transport(transport)
    try:
        if transport == "tcp":
            host, _, port = address.rpartition(":")
            sock = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address)
    except OSError as error:
        raise TransferError(f"cannot reach the KV receiver at {transport}://{address}: {error}") from None
    sock.settimeout(timeout)
    return sock


class KVListener:
    """The decode side's endpoint: accepts one incoming handoff at a time."""

    def __init__(self, transport: str, auth: HandoffAuth, address: str | None = None) -> None:
        """`address`: host:port for tcp (port 0 picks a free one; the default is loopback), a
        socket path for shm (default: a fresh path in the temporary directory). `auth`: the
        deployment's secret, which every handoff's frames must be signed with."""
        check_transport(transport)
        self.transport = transport
        self.auth = auth
        self.segment_maps = SegmentMaps()  # shm: mappings of the senders' reused segments
        if transport == "tcp":
            host, _, port = (address or "127.0.0.1:0").rpartition(":")
            self._sock = socket.create_server((host or "127.0.0.1", int(port)))
            bound_host, bound_port = self._sock.getsockname()[:2]
            # Listening on every interface: senders on other hosts need this host's address.
            self.address = f"{_host_address() if bound_host in ('0.0.0.0', '::') else bound_host}:{bound_port}"
        else:
            import tempfile

            self.address = address or os.path.join(tempfile.gettempdir(), f"pagoda-kv-{uuid.uuid4().hex[:12]}.sock")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(self.address)
            self._sock.listen()

    def accept(self, timeout: float) -> IncomingHandoff:
        """The next handoff, its header read; TransferError if none arrives within `timeout`."""
        return IncomingHandoff(self.accept_connection(timeout), self.transport, timeout, self.auth, self.segment_maps)

    def accept_connection(self, timeout: float) -> socket.socket:
        """The next sender's connection, before its header (TransferError after `timeout`)."""
        self._sock.settimeout(timeout)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TransferError(f"no KV handoff arrived within {timeout} s") from None
        conn.settimeout(timeout)
        return conn

    def close(self) -> None:
        self._sock.close()
        self.segment_maps.close()
        if self.transport == "shm":
            try:
                os.unlink(self.address)
            except FileNotFoundError:
                pass

    def __enter__(self) -> KVListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IncomingHandoff:
    """One handoff being received. The engine reads the header, answers how many leading
    blocks it already holds, then iterates over the rest as they arrive."""

    def __init__(
        self,
        conn: socket.socket,
        transport: str,
        timeout: float,
        auth: HandoffAuth,
        segment_maps: SegmentMaps | None = None,
    ) -> None:
        """`segment_maps`: the listener's mappings of shm segments (reused across handoffs).
        Raises TransferError (FrameRejected for a header not signed with `auth`'s secret)."""
        self._conn = conn
        self.transport = transport
        self.timeout = timeout
        self._maps = segment_maps if segment_maps is not None else SegmentMaps(capacity=0)
        self._shm: Any = None
        self.bytes_received = 0
        try:
            self._session = _exchange_nonces(conn, auth, True, _peer_name(conn, transport))
            self.header = HandoffHeader.from_json(bytes(_recv_frame(conn, self._session)))
        except (TransferError, ValueError, TypeError, KeyError) as error:
            conn.close()
            if isinstance(error, TransferError):
                raise
            raise TransferError(f"malformed KV handoff header: {error}") from None

    def reject(self, reason: str) -> None:
        """Refuse the blocks (the decode side will prefill itself); the sender sees TransferError."""
        try:
            _sendall(self._conn, self._session, json.dumps({"reject": reason}).encode())
        except TransferError:
            pass
        self.close()

    def receive(self, skip: int) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
        """Ask for blocks skip..num_blocks-1 and yield (block indices, one tensor per cache
        holding those blocks) for each run of them as it arrives (CPU tensors; valid until the
        next one is yielded). Acks at the end."""
        header = self.header
        _sendall(self._conn, self._session, json.dumps({"skip": skip}).encode())
        if self.transport == "shm" and skip < header.num_blocks:
            try:
                self._shm = self._maps.open(str(header.shm_name))
            except (FileNotFoundError, ValueError) as error:
                raise TransferError(f"KV shared-memory segment {header.shm_name!r} is gone: {error}") from None
        block_nbytes = header.block_nbytes
        # One reusable buffer: the yielded tensors view it. For shm each run is copied out of
        # the segment first, so no view into the sender's segment outlives this handoff.
        run_blocks = blocks_per_run(block_nbytes)
        wire = memoryview(bytearray(_RUN.size + run_blocks * block_nbytes + TAG_BYTES))
        capacity = len(wire) - TAG_BYTES
        expected = skip
        while expected < header.num_blocks:
            size = _recv_size(self._conn, capacity, self._session)
            if size < _RUN.size:
                raise TransferError(f"KV block frame of {size} bytes is malformed")
            frame = _recv_exact(self._conn, size + TAG_BYTES, wire[: size + TAG_BYTES])
            tag = bytes(frame[size:])
            if self.transport == "tcp":
                self._session.verify([frame[:size]], tag)
            first, count = _RUN.unpack(frame[: _RUN.size])
            if first != expected or not 0 < count <= min(run_blocks, header.num_blocks - first):
                raise TransferError(f"KV blocks {first}+{count} arrived, expected a run from block {expected}")
            nbytes = count * block_nbytes
            if self.transport == "tcp":
                if size != _RUN.size + nbytes:
                    raise TransferError(f"KV block frame of {size} bytes, expected {_RUN.size + nbytes}")
                payload = frame[_RUN.size : size]
            else:
                if size != _RUN.size:
                    raise TransferError(f"KV block notice of {size} bytes, expected {_RUN.size}")
                payload = wire[_RUN.size : _RUN.size + nbytes]
                # Verified on the copy (the tag was copied out before the run overwrote it): what
                # the segment holds may change under us, what we checked may not.
                payload[:] = self._shm.buf[first * block_nbytes : first * block_nbytes + nbytes]
                self._session.verify([frame[: _RUN.size], payload], tag)
            self.bytes_received += nbytes
            yield list(range(first, first + count)), _split_run(payload, header.layout, count)
            expected += count
        end = bytes(_recv_frame(self._conn, self._session))
        if end != _END:
            raise TransferError("KV transfer ended without its end frame")
        _sendall(self._conn, self._session, b"OK")

    def close(self) -> None:
        if self._shm is not None:
            self._maps.done(self._shm)
            self._shm = None
        self._conn.close()


def send_handoff(
    handoff: KVHandoff,
    transport: str,
    address: str,
    timeout: float,
    auth: HandoffAuth,
    segments: ShmSegments | None = None,
) -> int:
    """Ship `handoff` to the listener at `address`, every frame signed with `auth`'s secret;
    returns the number of blocks sent (the receiver's cache held the others). Raises
    TransferError if the receiver does not take it (FrameRejected: its replies were not signed
    with the same secret). `segments`: the sender's pool of shm segments (without one, a
    segment lives for one handoff)."""
    sock = _connect(transport, address, timeout)
    shm = None
    pool = segments if segments is not None else ShmSegments(max_free_bytes=0)
    delivered = refused = False
    try:
        session = _exchange_nonces(sock, auth, False, f"{transport}://{address}")
        header = handoff.header
        block_nbytes = header.block_nbytes
        if transport == "shm" and header.num_blocks:
            shm = pool.acquire(block_nbytes * header.num_blocks)
            header.shm_name = shm.name
        _sendall(sock, session, header.to_json())
        reply = json.loads(bytes(_recv_frame(sock, session)))
        if "reject" in reply:
            refused = True
            raise HandoffRefused(f"the KV receiver refused the handoff: {reply['reject']}")
        skip = int(reply["skip"])
        per_block = [t.reshape(t.shape[0], -1).view(torch.uint8) for t in handoff.blocks]
        run_blocks = blocks_per_run(block_nbytes)
        for first in range(skip, header.num_blocks, run_blocks):
            last = min(first + run_blocks, header.num_blocks)
            parts = [t[first:last].numpy().data.cast("B") for t in per_block]
            notice = _RUN.pack(first, last - first)
            if shm is not None:
                buf = shm.buf
                assert buf is not None  # None only once the segment is closed
                offset = first * block_nbytes
                for part in parts:
                    buf[offset : offset + len(part)] = part
                    offset += len(part)
                _sendall(sock, session, notice, signed_too=parts)
            else:
                _sendall(sock, session, notice, *parts)
        _sendall(sock, session, _END)
        if bytes(_recv_frame(sock, session)) != b"OK":
            raise TransferError("the KV receiver did not acknowledge the handoff")
        delivered = True
        return header.num_blocks - skip
    finally:
        sock.close()
        if shm is not None:
            if delivered or refused:
                pool.release(shm)  # the receiver has copied everything out (or never looked)
            else:
                pool.discard(shm)


def blocks_per_run(block_nbytes: int) -> int:
    """Blocks per frame: as many as fit in CHUNK_BYTES, at least one."""
    return max(1, CHUNK_BYTES // max(block_nbytes, 1))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"unknown KV dtype {name!r} in a handoff header")
    return dtype


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _split_run(payload: memoryview, layout: Sequence[tuple[str, Sequence[int]]], count: int) -> list[torch.Tensor]:
    """A run's bytes (each cache tensor's `count` blocks in turn) -> one tensor per cache
    tensor, viewing `payload` (no copy)."""
    tensors = []
    offset = 0
    for dtype_name, shape in layout:
        dtype = _dtype(dtype_name)
        size = dtype.itemsize * _numel(shape) * count
        raw = (
            torch.frombuffer(payload[offset : offset + size], dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(raw.view(dtype).reshape(count, *shape))
        offset += size
    return tensors


def _peer_name(conn: socket.socket, transport: str) -> str:
    """Who is on the other end, for the log."""
    if transport != "tcp":
        return f"{transport} peer"
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a tcp peer"
    return f"{host}:{port}"


def _host_address() -> str:
    """This host's address as other hosts reach it (the interface of the default route)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def layout_of(caches: Sequence[torch.Tensor]) -> list[tuple[str, list[int]]]:
    """The per-block layout of a set of cache tensors (blocks first), as headers carry it."""
    return [(str(c.dtype).removeprefix("torch."), list(c.shape[1:])) for c in caches]
