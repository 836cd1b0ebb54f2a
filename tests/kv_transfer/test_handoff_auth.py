"""The KV handoff channel is authenticated and never unpickles: a crafted pickle (whose
__reduce__ would create a marker file) sent to a decode engine's listener runs nothing and is
refused, counted and logged; so is a handoff signed with another deployment's secret, in either
direction (a reply signed for another connection); the listener binds to loopback unless a multi-node setting asks
otherwise."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

import pagoda.kv_transfer.handoff as wire
from pagoda.config import EngineConfig
from pagoda.engine.kv_connector import _listen_address, transfer_secret
from pagoda.kv_transfer.handoff import (
    TRANSFER_SECRET_ENV,
    FrameRejected,
    HandoffAuth,
    HandoffHeader,
    KVHandoff,
    KVListener,
    TransferError,
    layout_of,
    send_handoff,
)
from pagoda.kv_transfer.handoff_threads import HandoffThreads

SECRET = "a" * 32
OTHER = "b" * 32


class _Marker:
    """Unpickling this creates the file at `path`: proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def crafted(marker: Path) -> bytes:
    return pickle.dumps(_Marker(marker))


def handoff() -> KVHandoff:
    caches = [torch.randn(4, 4, 2, 8) for _ in range(2)]
    header = HandoffHeader(
        request_id="r",
        prompt_token_ids=list(range(8)),
        output_token_ids=[7],
        sampling_params={},
        cache_salt=None,
        lora_name=None,
        block_size=4,
        block_hashes=["00", "01"],
        num_blocks=2,
        layout=layout_of(caches),
        fingerprint="f",
    )
    return KVHandoff(header, [c[:2].clone() for c in caches])


def connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


@pytest.mark.parametrize("framed", [False, True], ids=["raw", "framed"])
def test_a_pickle_sent_to_the_listener_runs_nothing(tmp_path: Path, framed: bool, caplog) -> None:
    marker = tmp_path / "ran"
    auth = HandoffAuth(SECRET)
    with KVListener("tcp", auth) as listener, connect(listener.address) as attacker:
        payload = crafted(marker)
        if framed:  # as the old JSON frames were sent, speaking the nonce exchange, unsigned

            def send() -> None:
                attacker.recv(wire.NONCE_BYTES)
                attacker.sendall(b"\0" * wire.NONCE_BYTES)
                attacker.sendall((len(payload) + wire.TAG_BYTES).to_bytes(8, "big") + payload + b"\0" * 32)

            threading.Thread(target=send).start()
        else:
            attacker.sendall(payload)
        with (
            caplog.at_level(logging.ERROR, logger="pagoda.kv_transfer.handoff"),
            pytest.raises(FrameRejected, match="bad signature" if framed else "outside"),
        ):
            listener.accept(timeout=5)
    assert auth.rejected == 1 and "refused frame 1" in caplog.text
    assert not marker.exists()


def test_a_decode_engines_threads_refuse_and_count_a_pickle(tmp_path: Path) -> None:
    """As a decode engine listens: the connection is dropped, no header reaches the engine."""
    marker = tmp_path / "ran"
    threads = HandoffThreads(HandoffAuth(SECRET))
    try:
        address = threads.listen("tcp", "127.0.0.1:0", 5.0)
        with connect(address) as attacker:
            attacker.sendall(crafted(marker))
            deadline = time.monotonic() + 10
            while threads.auth.rejected == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert threads.auth.rejected == 1 and threads.take_events() == []
    finally:
        threads.close()
    assert not marker.exists()


def test_another_deployments_handoff_is_refused() -> None:
    receiver_auth, sender_auth = HandoffAuth(SECRET), HandoffAuth(OTHER)
    with KVListener("tcp", receiver_auth) as listener:
        outcome: dict = {}
        thread = threading.Thread(
            target=lambda: outcome.update(
                error=pytest.raises(TransferError, send_handoff, handoff(), "tcp", listener.address, 5.0, sender_auth)
            )
        )
        thread.start()
        with pytest.raises(FrameRejected, match="bad signature"):
            listener.accept(timeout=5)
        thread.join()
    assert receiver_auth.rejected == 1


def test_a_reply_not_signed_for_this_connection_is_refused() -> None:
    """A receiver that answers with a frame signed for another connection (a replay)."""
    auth = HandoffAuth(SECRET)
    server = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{server.getsockname()[1]}"

    def fake_receiver() -> None:
        conn, _ = server.accept()
        with conn:
            session = wire._exchange_nonces(conn, auth, True, "sender")
            wire._recv_frame(conn, session)
            stale = auth.session(b"\1" * 16, b"\2" * 16, wire._TO_SENDER)  # another connection's nonces
            wire._sendall(conn, stale, b'{"skip": 0}')
            time.sleep(0.2)

    thread = threading.Thread(target=fake_receiver)
    thread.start()
    with pytest.raises(FrameRejected, match="bad signature"):
        send_handoff(handoff(), "tcp", address, 5.0, auth)
    thread.join()
    server.close()
    assert auth.rejected == 1


def test_shm_runs_are_signed_with_their_bytes() -> None:
    """Over shm the blocks travel in the segment: a run changed there after signing is refused."""
    auth = HandoffAuth(SECRET)
    sent = handoff()
    with KVListener("shm", auth) as listener:
        outcome: dict = {}
        thread = threading.Thread(
            target=lambda: outcome.update(
                error=pytest.raises(TransferError, send_handoff, sent, "shm", listener.address, 5.0, auth)
            )
        )
        thread.start()
        incoming = listener.accept(timeout=5)
        maps = incoming._maps
        opened, done = maps.open, maps.done

        class Tampered:  # another local process writes into the segment after the sender signed
            def __init__(self, segment) -> None:
                self.segment = segment

            @property
            def buf(self) -> memoryview:
                data = bytearray(self.segment.buf)
                data[0] ^= 0xFF
                return memoryview(data)

        maps.open = lambda name: Tampered(opened(name))
        maps.done = lambda segment: done(segment.segment)
        with pytest.raises(FrameRejected, match="bad signature"):
            list(incoming.receive(0))
        incoming.close()
        thread.join()
    assert auth.rejected == 1


def test_a_role_engine_needs_the_secret(monkeypatch) -> None:
    monkeypatch.delenv(TRANSFER_SECRET_ENV, raising=False)
    config = EngineConfig(role="decode")
    with pytest.raises(ValueError, match="KV transfer secret"):
        transfer_secret(config)
    monkeypatch.setenv(TRANSFER_SECRET_ENV, OTHER)
    assert transfer_secret(config) == OTHER
    assert transfer_secret(EngineConfig(role="decode", kv_transfer_secret=SECRET)) == SECRET
    with pytest.raises(ValueError, match="kv_transfer_secret must have at least 32 characters"):
        EngineConfig(kv_transfer_secret="short")
    with pytest.raises(ValueError, match="at least 32"):
        HandoffAuth("short")
    assert SECRET not in repr(EngineConfig(kv_transfer_secret=SECRET))


def test_the_listener_binds_loopback_unless_asked() -> None:
    assert _listen_address(EngineConfig(role="decode")) == "127.0.0.1:0"
    assert _listen_address(EngineConfig(role="decode", kv_listen="0.0.0.0:7000")) == "0.0.0.0:7000"
    with KVListener("tcp", HandoffAuth(SECRET)) as listener:
        assert listener.address.startswith("127.0.0.1:")
