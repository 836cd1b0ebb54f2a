"""The KV handoff wire (pagoda/kv_transfer/handoff.py) on its own: blocks arrive bit-exact over
each transport, only the blocks the receiver lacks travel, and a dropped, stalled or refused
transfer raises TransferError on both sides without leaving a shared-memory segment behind."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
import torch

import pagoda.kv_transfer.handoff as wire
from pagoda.kv_transfer.block_transfer import gather_blocks, scatter_blocks
from pagoda.kv_transfer.handoff import (
    HandoffAuth,
    HandoffHeader,
    KVHandoff,
    KVListener,
    TransferError,
    TransportUnavailable,
    check_transport,
    layout_of,
    send_handoff,
)

TRANSPORTS = ("tcp", "shm")
SECRET = "s" * 32  # the deployment's: both sides sign with it
AUTH = HandoffAuth(SECRET)


def make_caches(dtype: torch.dtype = torch.float32, num_blocks: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(4):  # two layers' keys and values
        values = torch.randn((num_blocks, 4, 2, 8), generator=generator)
        caches.append(values.to(dtype) if dtype.is_floating_point else (values * 40).to(dtype))
    return caches


def make_handoff(caches: list[torch.Tensor], block_ids: list[int]) -> KVHandoff:
    header = HandoffHeader(
        request_id="r",
        prompt_token_ids=list(range(4 * len(block_ids))),
        output_token_ids=[7],
        sampling_params={},
        cache_salt=None,
        lora_name=None,
        block_size=4,
        block_hashes=[f"{i:02x}" for i in range(len(block_ids))],
        num_blocks=len(block_ids),
        layout=layout_of(caches),
        fingerprint="f",
    )
    return KVHandoff(header, [t.cpu() for t in gather_blocks(caches, block_ids)])


def send_in_thread(handoff: KVHandoff, transport: str, address: str, timeout: float = 5.0) -> dict:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["sent"] = send_handoff(handoff, transport, address, timeout, AUTH)
        except TransferError as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    outcome["thread"] = thread
    return outcome


def send_signed_header(peer: socket.socket, payload: bytes, auth: HandoffAuth = AUTH) -> threading.Thread:
    """What a sender sends first (its nonce once it has the receiver's, then the header frame,
    signed), from a thread: the receiver speaks first, once accepted."""

    def run() -> None:
        session = wire._exchange_nonces(peer, auth, False, "the receiver")
        wire._sendall(peer, session, payload)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def shm_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("pagoda-kv-*")} if shm.is_dir() else set()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "dtype,runs", [(torch.float32, [[1, 2]]), (torch.bfloat16, [[1], [2]]), (torch.int8, [[1], [2]])]
)
def test_blocks_arrive_bit_exact_and_cached_ones_stay_home(transport, dtype, runs, monkeypatch):
    before = shm_segments()
    source = make_caches(dtype)
    target = [torch.zeros_like(c) for c in source]
    handoff = make_handoff(source, [5, 1, 6])
    if len(runs) > 1:  # one block per frame
        monkeypatch.setattr(wire, "CHUNK_BYTES", handoff.header.block_nbytes)
    with KVListener(transport, AUTH) as listener:
        outcome = send_in_thread(handoff, transport, listener.address)
        incoming = listener.accept(timeout=5)
        assert incoming.header.layout == layout_of(source) and incoming.header.output_token_ids == [7]
        arrived = []
        for indices, data in incoming.receive(skip=1):  # the receiver already holds block 0
            scatter_blocks(target, [[0, 2, 3][i] for i in indices], data)
            arrived.append(indices)
        incoming.close()
        outcome["thread"].join()
    assert outcome == {"sent": 2, "thread": outcome["thread"]}
    assert arrived == runs
    assert incoming.bytes_received == 2 * handoff.header.block_nbytes
    for src, dst in zip(source, target):
        assert torch.equal(dst[2], src[1]) and torch.equal(dst[3], src[6])
        assert not dst[0].any()  # skipped: never sent
    assert shm_segments() == before


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refusal_reaches_the_sender(transport):
    handoff = make_handoff(make_caches(), [0, 1])
    with KVListener(transport, AUTH) as listener:
        outcome = send_in_thread(handoff, transport, listener.address)
        listener.accept(timeout=5).reject("layout differs")
        outcome["thread"].join()
    assert "layout differs" in str(outcome["error"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receiver_times_out_on_a_stalled_sender(transport):
    """A sender that sends its header and then stalls: the receiver gives up after its timeout."""
    handoff = make_handoff(make_caches(), [0, 1, 2])
    with KVListener(transport, AUTH) as listener:
        family = socket.AF_INET if transport == "tcp" else socket.AF_UNIX
        stalled = socket.socket(family, socket.SOCK_STREAM)
        host, _, port = listener.address.rpartition(":")
        stalled.connect((host, int(port)) if transport == "tcp" else listener.address)
        sender = send_signed_header(stalled, handoff.header.to_json())
        incoming = listener.accept(timeout=0.3)
        sender.join()
        with pytest.raises(TransferError, match="timed out|gone"):
            list(incoming.receive(skip=0))
        incoming.close()
        stalled.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dropped_connection_fails_both_sides(transport, monkeypatch):
    before = shm_segments()
    handoff = make_handoff(make_caches(), [0, 1, 2, 3])
    monkeypatch.setattr(wire, "CHUNK_BYTES", handoff.header.block_nbytes)  # one block per frame
    with KVListener(transport, AUTH) as listener:
        outcome = send_in_thread(handoff, transport, listener.address)
        incoming = listener.accept(timeout=5)
        blocks = incoming.receive(skip=0)
        next(blocks)
        incoming.close()  # the receiver goes away after one block
        outcome["thread"].join()
    assert isinstance(outcome.get("error"), TransferError)
    assert shm_segments() == before


def test_unreachable_receiver_and_unknown_transport():
    with pytest.raises(TransportUnavailable, match="unknown KV transport 'rdma'"):
        check_transport("rdma")
    with pytest.raises(TransferError, match="cannot reach"):
        send_handoff(make_handoff(make_caches(), [0]), "shm", f"/tmp/pagoda-missing-{os.getpid()}.sock", 1.0, AUTH)


def test_malformed_header_is_a_transfer_error():
    with KVListener("tcp", AUTH) as listener:
        host, _, port = listener.address.rpartition(":")
        with socket.create_connection((host, int(port))) as peer:
            sender = send_signed_header(peer, b'{"request_id": "r", "unknown": 1}')
            with pytest.raises(TransferError, match="malformed KV handoff header"):
                listener.accept(timeout=5)
            sender.join()


def test_shm_segments_are_reused_across_handoffs_and_dropped_after_a_failure():
    """A sender's pool reuses one segment for handoffs that fit it; the receiver keeps it mapped;
    a segment whose handoff failed is unlinked, not reused; closing leaves nothing in /dev/shm."""
    from pagoda.kv_transfer.shm_segments import ShmSegments

    before = shm_segments()
    caches = make_caches()
    pool = ShmSegments()
    with KVListener("shm", AUTH) as listener:
        received = []
        for block_ids in ([1, 2, 3], [4, 5], [6]):
            handoff = make_handoff(caches, block_ids)
            outcome: dict = {}
            thread = threading.Thread(
                target=lambda h=handoff, outcome=outcome: outcome.update(
                    sent=send_handoff(h, "shm", listener.address, 5.0, AUTH, pool)
                )
            )
            thread.start()
            incoming = listener.accept(5.0)
            target = [torch.zeros_like(c) for c in caches]
            for indices, data in incoming.receive(0):
                scatter_blocks(target, [block_ids[i] for i in indices], data)
            incoming.close()
            thread.join()
            assert outcome["sent"] == len(block_ids)
            assert all(torch.equal(t[block_ids], c[block_ids]) for t, c in zip(target, caches))
            received.append(handoff.header.shm_name)
        assert pool.num_created == 1 and len(set(received)) == 1  # one segment served all three
        assert list(listener.segment_maps._maps) == received[:1]  # mapped once on the receiver
        # The receiver drops the connection mid-transfer: that segment is not reused.
        handoff = make_handoff(caches, [1, 2])
        outcome = {}
        thread = threading.Thread(
            target=lambda: outcome.update(
                error=pytest.raises(TransferError, send_handoff, handoff, "shm", listener.address, 5.0, AUTH, pool)
            )
        )
        thread.start()
        incoming = listener.accept(5.0)
        incoming.close()
        thread.join()
        assert handoff.header.shm_name == received[0]
        assert handoff.header.shm_name not in shm_segments()  # unlinked after the failure
        pool.close()
    assert shm_segments() == before
