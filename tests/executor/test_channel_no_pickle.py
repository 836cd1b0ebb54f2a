"""No internal channel unpickles: a crafted pickle (whose __reduce__ would create a marker
file) sent to each of them is refused and runs nothing.

The channels: a worker's spec on its stdin (mp backend) and in its Ray actor call, the control
broadcast of rank 0 (KVSetup, StepInputs, the stop), the steps a pipeline stage receives from the
stage before it, and a stage's share to its tensor-parallel ranks. Each is exercised with a real
gloo group of two ranks in one process (a thread per rank)."""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_groups import KVCacheGroup
from pagoda.executor.channel import MAX_MESSAGE_BYTES, ChannelCodec, RejectedMessage, decode, encode, new_secret
from pagoda.executor.group import Endpoint, broadcast_object, open_payload, recv_payload, share_payload
from pagoda.executor.process_workers import read_spec, spec_frame, worker_command
from pagoda.executor.worker import KVSetup, StageMessage, StepInputs, WorkerSpec
from pagoda.kernels.attention import BatchLayout

ROOT = Path(__file__).resolve().parents[2]


class _Marker:
    """Unpickling this creates the file at `path`: proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def crafted(marker: Path) -> bytes:
    return pickle.dumps(_Marker(marker))


def step() -> StepInputs:
    layout = BatchLayout(
        torch.arange(5),
        torch.tensor([0, 5]),
        torch.tensor([0]),
        torch.tensor([5]),
        torch.zeros(1, 3, dtype=torch.int32),
        16,
        [5],
        [0],
    )
    return StepInputs(torch.arange(5), torch.arange(5), [layout], [4], [(1, 2)])


def spec(secret: bytes = b"s" * 32) -> WorkerSpec:
    return WorkerSpec(EngineConfig(), 1, 2, Endpoint("127.0.0.1", 1), "cpu", torch.float32, 1, 30.0, secret)


def test_messages_round_trip_typed() -> None:
    codec = ChannelCodec(new_secret())
    received = codec.open(codec.seal(StageMessage(step())), StageMessage, "test").step
    assert torch.equal(received.input_ids, step().input_ids)
    assert received.layouts[0].block_tables.dtype == torch.int32 and received.block_copies == [(1, 2)]
    assert codec.open(codec.seal(None), StepInputs | None, "test") is None
    assert codec.open(codec.seal(KVSetup(8, [KVCacheGroup((0, 1), 4)])), KVSetup, "test").kv_groups[0].window == 4
    assert decode(encode(spec()), WorkerSpec) == spec()


def test_a_pickle_is_refused_signed_or_not(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    secret = new_secret()
    codec = ChannelCodec(secret)
    with pytest.raises(RejectedMessage, match="bad signature"):
        codec.open(b"\0" * 32 + crafted(marker), StepInputs | None, "rank 0")
    # Even one signed with the deployment's secret only decodes to the expected type.
    import hashlib
    import hmac

    body = crafted(marker)
    with pytest.raises(RejectedMessage, match="not a"):
        codec.open(hmac.new(secret, body, hashlib.sha256).digest() + body, StepInputs | None, "rank 0")
    with pytest.raises(RejectedMessage, match="bad signature"):  # another deployment's message
        codec.open(ChannelCodec(new_secret()).seal(None), StepInputs | None, "rank 0")
    assert codec.rejected == 3
    assert not marker.exists()


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_refused() -> None:
    codec = ChannelCodec(new_secret())
    forged = step()
    forged.input_ids = torch.arange(5)
    sealed = codec.seal(StageMessage(forged))
    body = sealed[32:].replace(b"\x91\x05", b"\x91\x06", 1)  # shape [5] -> [6], same bytes
    import hashlib
    import hmac

    resealed = hmac.new(codec._secret, body, hashlib.sha256).digest() + body
    with pytest.raises(RejectedMessage, match="needs 48 bytes"):
        codec.open(resealed, StageMessage, "rank 0")


def test_a_size_larger_than_any_message_is_refused_before_allocating() -> None:
    codec = ChannelCodec(new_secret())
    with pytest.raises(RejectedMessage, match="announced size"):
        codec.check_size(1 << 50, "rank 0")
    with pytest.raises(RejectedMessage, match="announced size"):
        codec.check_size(-1, "rank 0")
    assert codec.check_size(MAX_MESSAGE_BYTES, "rank 0") == MAX_MESSAGE_BYTES


def _two_ranks(attacker, victim) -> list[BaseException | object]:
    """Run `attacker(group)` as rank 0 and `victim(group)` as rank 1 of a gloo group; returns
    what the victim returned or raised."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    results: list = []

    def rank(index: int, body) -> None:
        client = (
            store
            if index == 0
            else dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=30))
        )
        group = dist.ProcessGroupGloo(dist.PrefixStore("control", client), index, 2, datetime.timedelta(seconds=30))
        try:
            out = body(group)
        except BaseException as error:  # noqa: BLE001 - the victim's outcome is the test's
            out = error
        if index == 1:
            results.append(out)

    threads = [threading.Thread(target=rank, args=(0, attacker)), threading.Thread(target=rank, args=(1, victim))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _raw(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def test_the_control_broadcast_refuses_a_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    codec = ChannelCodec(new_secret())
    payload = _raw(crafted(marker))

    def attacker(group) -> None:  # rank 0's broadcast as the old pickle channel sent it
        group.broadcast(torch.tensor([payload.numel()], dtype=torch.long), 0).wait()
        group.broadcast(payload, 0).wait()

    def victim(group):
        return broadcast_object(group, codec, None, 1, StepInputs | None)

    (outcome,) = _two_ranks(attacker, victim)
    assert isinstance(outcome, RejectedMessage) and codec.rejected == 1
    assert not marker.exists()


def test_the_broadcast_still_carries_signed_messages() -> None:
    secret = new_secret()

    def sender(group) -> None:
        broadcast_object(group, ChannelCodec(secret), KVSetup(8, [KVCacheGroup((0,))]), 0)

    def receiver(group):
        return broadcast_object(group, ChannelCodec(secret), None, 1, KVSetup)

    (outcome,) = _two_ranks(sender, receiver)
    assert outcome == KVSetup(8, [KVCacheGroup((0,))])


def test_a_pipeline_stage_refuses_a_pickle_and_a_huge_size(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    codec = ChannelCodec(new_secret())
    payload = _raw(crafted(marker))

    def attacker(group) -> None:  # the previous stage's point-to-point step, as a pickle
        group.send([torch.tensor([payload.numel()], dtype=torch.long)], 1, 4).wait()
        group.send([payload], 1, 4).wait()
        group.send([torch.tensor([1 << 45], dtype=torch.long)], 1, 4).wait()

    def victim(group):
        outcomes = []
        for _ in range(2):
            try:
                outcomes.append(open_payload(codec, recv_payload(group, codec, 0, 4), StageMessage, "rank 0"))
            except RejectedMessage as error:
                outcomes.append(error)
        return outcomes

    (outcomes,) = _two_ranks(attacker, victim)
    assert [type(o) for o in outcomes] == [RejectedMessage, RejectedMessage]
    assert "announced size" in str(outcomes[1]) and codec.rejected == 2
    assert not marker.exists()


def test_a_stage_share_refuses_a_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    codec = ChannelCodec(new_secret())
    forged = _raw(crafted(marker))

    def lead(group) -> None:
        share_payload(group, ChannelCodec(new_secret()), forged, 0)

    def member(group):
        return open_payload(codec, share_payload(group, codec, None, 1), StageMessage, "the stage's lead")

    (outcome,) = _two_ranks(lead, member)
    assert isinstance(outcome, RejectedMessage)
    assert not marker.exists()


def test_a_worker_process_refuses_a_pickled_spec(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    for stdin in (crafted(marker), len(crafted(marker)).to_bytes(4, "big") + crafted(marker)):
        done = subprocess.run(worker_command(), input=stdin, capture_output=True, env=env, timeout=120)
        assert done.returncode == 2, done.stderr.decode()[-2000:]
        assert b"worker refused its spec" in done.stderr and b"Traceback" not in done.stderr
    assert not marker.exists()


def test_the_spec_frame_reads_back(tmp_path: Path) -> None:
    import io

    assert read_spec(io.BytesIO(spec_frame(spec()))) == spec()
    with pytest.raises(ValueError, match="is not one"):
        read_spec(io.BytesIO((1 << 31).to_bytes(4, "big")))


def test_the_ray_actor_decodes_its_spec_typed(tmp_path: Path) -> None:
    """The Ray backend hands its actors the same encoded spec: a pickle is refused there too."""
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="not a WorkerSpec"):
        decode(crafted(marker), WorkerSpec)
    assert not marker.exists()


def test_no_module_of_the_package_unpickles() -> None:
    hits = []
    for path in (ROOT / "pagoda").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if "pickle.load" in text or "torch.load(" in text:
            hits.append(str(path.relative_to(ROOT)))
    assert hits == []
