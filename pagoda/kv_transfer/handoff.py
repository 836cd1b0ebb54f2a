"""Moving one prefilled request's KV blocks from a prefill engine to a decode engine.

One small interface, two transports:

- `tcp`: the decode side listens on host:port; block bytes travel inside the socket's frames.
- `shm`: one host. The control frames travel on a Unix socket (its path is the address); the
  block bytes are written by the sender into a POSIX shared-memory segment and copied by the
  receiver out of it (they never pass through the socket).

The exchange, in length-prefixed frames (8-byte big-endian length, then the payload):

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
"""

from __future__ import annotations

import json
import os
import socket
import struct
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.kv_transfer.shm_segments import SegmentMaps, ShmSegments

TRANSPORTS = ("tcp", "shm")
_LENGTH = struct.Struct(">Q")
_RUN = struct.Struct(">II")  # first block index, number of blocks
CHUNK_BYTES = 2 << 20  # a run of blocks per frame: large enough to amortize, small enough to overlap
_END = b"END"
MAX_HEADER_BYTES = 64 << 20  # a header larger than this is not a handoff header


class TransferError(RuntimeError):
    """A handoff that did not complete: connection dropped, timed out, or refused."""


class HandoffRefused(TransferError):
    """The receiver will not use the sender's KV (or first token) for this request: another
    model, block layout, tenant salt or adapter produced it."""


class TransportUnavailable(TransferError):
    """The transport asked for cannot run here (unknown name, no shared memory, no Unix sockets)."""


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

def _send_frame(sock: socket.socket, *parts: bytes | memoryview) -> None:
    sock.sendall(_LENGTH.pack(sum(len(p) for p in parts)))
    for part in parts:
        sock.sendall(part)


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


def _recv_frame(sock: socket.socket, limit: int = MAX_HEADER_BYTES) -> memoryview:
    (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if size > limit:
        raise TransferError(f"KV transfer frame of {size} bytes exceeds the limit of {limit}")
    return _recv_exact(sock, size)


def _sendall(sock: socket.socket, *parts: bytes | memoryview) -> None:
    try:
        _send_frame(sock, *parts)
    except TimeoutError:
        raise TransferError("KV transfer timed out sending to the peer") from None
    except OSError as error:
        raise TransferError(f"KV transfer connection failed: {error}") from None


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

    def __init__(self, transport: str, address: str | None = None) -> None:
        """`address`: host:port for tcp (port 0 picks a free one), a socket path for shm
        (default: a fresh path in the temporary directory)."""
        check_transport(transport)
        self.transport = transport
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
        return IncomingHandoff(self.accept_connection(timeout), self.transport, timeout, self.segment_maps)

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

    def __init__(self, conn: socket.socket, transport: str, timeout: float,
                 segment_maps: SegmentMaps | None = None) -> None:
        """`segment_maps`: the listener's mappings of shm segments (reused across handoffs)."""
        self._conn = conn
        self.transport = transport
        self.timeout = timeout
        self._maps = segment_maps if segment_maps is not None else SegmentMaps(capacity=0)
        self._shm: Any = None
        self.bytes_received = 0
        try:
            self.header = HandoffHeader.from_json(bytes(_recv_frame(conn)))
        except (TransferError, ValueError, TypeError, KeyError) as error:
            conn.close()
            if isinstance(error, TransferError):
                raise
            raise TransferError(f"malformed KV handoff header: {error}") from None

    def reject(self, reason: str) -> None:
        """Refuse the blocks (the decode side will prefill itself); the sender sees TransferError."""
        try:
            _sendall(self._conn, json.dumps({"reject": reason}).encode())
        except TransferError:
            pass
        self.close()

    def receive(self, skip: int) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
        """Ask for blocks skip..num_blocks-1 and yield (block indices, one tensor per cache
        holding those blocks) for each run of them as it arrives (CPU tensors; valid until the
        next one is yielded). Acks at the end."""
        header = self.header
        _sendall(self._conn, json.dumps({"skip": skip}).encode())
        if self.transport == "shm" and skip < header.num_blocks:
            try:
                self._shm = self._maps.open(str(header.shm_name))
            except (FileNotFoundError, ValueError) as error:
                raise TransferError(f"KV shared-memory segment {header.shm_name!r} is gone: {error}") from None
        block_nbytes = header.block_nbytes
        # One reusable buffer: the yielded tensors view it. For shm each run is copied out of
        # the segment first, so no view into the sender's segment outlives this handoff.
        run_blocks = blocks_per_run(block_nbytes)
        wire = memoryview(bytearray(_RUN.size + run_blocks * block_nbytes))
        expected = skip
        while expected < header.num_blocks:
            (size,) = _LENGTH.unpack(_recv_exact(self._conn, _LENGTH.size))
            if size < _RUN.size or size > len(wire):
                raise TransferError(f"KV block frame of {size} bytes is malformed")
            frame = _recv_exact(self._conn, size, wire[:size])
            first, count = _RUN.unpack(frame[:_RUN.size])
            if first != expected or not 0 < count <= min(run_blocks, header.num_blocks - first):
                raise TransferError(f"KV blocks {first}+{count} arrived, expected a run from block {expected}")
            nbytes = count * block_nbytes
            if self.transport == "tcp":
                if size != _RUN.size + nbytes:
                    raise TransferError(f"KV block frame of {size} bytes, expected {_RUN.size + nbytes}")
                payload = frame[_RUN.size:]
            else:
                if size != _RUN.size:
                    raise TransferError(f"KV block notice of {size} bytes, expected {_RUN.size}")
                payload = wire[_RUN.size:_RUN.size + nbytes]
                payload[:] = self._shm.buf[first * block_nbytes:first * block_nbytes + nbytes]
            self.bytes_received += nbytes
            yield list(range(first, first + count)), _split_run(payload, header.layout, count)
            expected += count
        end = bytes(_recv_frame(self._conn))
        if end != _END:
            raise TransferError("KV transfer ended without its end frame")
        _sendall(self._conn, b"OK")

    def close(self) -> None:
        if self._shm is not None:
            self._maps.done(self._shm)
            self._shm = None
        self._conn.close()


def send_handoff(handoff: KVHandoff, transport: str, address: str, timeout: float,
                 segments: ShmSegments | None = None) -> int:
    """Ship `handoff` to the listener at `address`; returns the number of blocks sent (the
    receiver's cache held the others). Raises TransferError if the receiver does not take it.
    `segments`: the sender's pool of shm segments (without one, a segment lives for one handoff)."""
    sock = _connect(transport, address, timeout)
    shm = None
    pool = segments if segments is not None else ShmSegments(max_free_bytes=0)
    delivered = refused = False
    try:
        header = handoff.header
        block_nbytes = header.block_nbytes
        if transport == "shm" and header.num_blocks:
            shm = pool.acquire(block_nbytes * header.num_blocks)
            header.shm_name = shm.name
        _sendall(sock, header.to_json())
        reply = json.loads(bytes(_recv_frame(sock)))
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
                    buf[offset:offset + len(part)] = part
                    offset += len(part)
                _sendall(sock, notice)
            else:
                _sendall(sock, notice, *parts)
        _sendall(sock, _END)
        if bytes(_recv_frame(sock)) != b"OK":
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
        raw = torch.frombuffer(payload[offset:offset + size], dtype=torch.uint8) if size \
            else torch.empty(0, dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(count, *shape))
        offset += size
    return tensors


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
