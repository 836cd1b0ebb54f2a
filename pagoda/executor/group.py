"""Joining the tensor-parallel group, and the control channel that carries Python objects.

Each group is a standalone torch.distributed backend object built on a TCPStore that rank 0
hosts (no process-global default group, so several engines can live in one process one after
another). On CPU one gloo group does everything; on CUDA the model's collectives run on NCCL
and the control messages on a second, gloo, group (typed messages signed with the deployment's
secret, pagoda.executor.channel; never pickles).

Gloo notices a peer that died at once (its socket closes: "Connection closed by peer"), so a
rank blocked in a collective fails instead of hanging; the groups get a very long operation
timeout because a worker waits in a broadcast for as long as the engine is idle.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagoda.executor.channel import ChannelCodec
from pagoda.model.parallel import TensorParallelGroup

# A worker waits for the next step as long as the engine stays idle.
OPERATION_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Endpoint:
    """Where rank 0's TCPStore listens."""

    host: str
    port: int


@dataclass
class Groups:
    """A rank's views of the group: the model's collectives and the control channel (and, for
    a pipeline stage of several tensor-parallel ranks, the stage's own control group)."""

    model: TensorParallelGroup
    control: Any  # a torch.distributed backend (ProcessGroupGloo) of every rank
    store: Any  # kept alive while the groups are (rank 0 hosts it)
    stage: Any = None  # pipeline x tensor parallelism: gloo among the stage's ranks (stage rank 0 leads)


def host_store(host: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's TCPStore on a free port (workers connect to it)."""
    return dist.TCPStore(
        host, 0, world_size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join(
    rank: int,
    world_size: int,
    device: torch.device,
    store: Any,
    expert_parallel: bool = False,
    stage_ranks: int | None = None,
) -> Groups:
    """Build this rank's groups; returns once every rank has joined. `expert_parallel`: the
    model's group places MoE experts whole on ranks (pagoda.model.parallel). `stage_ranks`:
    the ranks are pipeline stages of this many tensor-parallel ranks each (global rank =
    stage x stage_ranks + rank in the stage); the control group joins them all and carries the
    hidden states between stages, the model's group is the stage's."""
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, OPERATION_TIMEOUT)
    if stage_ranks is None:
        return Groups(_model_group(rank, world_size, device, store, "model", control, expert_parallel), control, store)
    if stage_ranks == 1:
        return Groups(TensorParallelGroup(), control, store)
    stage, local = divmod(rank, stage_ranks)
    stage_control = dist.ProcessGroupGloo(
        dist.PrefixStore(f"stage{stage}/control", store), local, stage_ranks, OPERATION_TIMEOUT
    )
    model = _model_group(local, stage_ranks, device, store, f"stage{stage}/model", stage_control, expert_parallel)
    return Groups(model, control, store, stage_control)


def _model_group(
    rank: int, world_size: int, device: torch.device, store: Any, prefix: str, gloo: Any, expert_parallel: bool
) -> TensorParallelGroup:
    """NCCL on CUDA, else the given gloo group."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        backend = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, world_size, options)
    else:
        backend = gloo
    return TensorParallelGroup(rank, world_size, backend, expert_parallel)


def connect(
    rank: int,
    world_size: int,
    device: torch.device,
    endpoint: Endpoint,
    timeout_s: float,
    expert_parallel: bool = False,
    stage_ranks: int | None = None,
) -> Groups:
    """A worker's side: connect to rank 0's store, say so (see `wait_for_workers`), then join."""
    store = dist.TCPStore(
        endpoint.host, endpoint.port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    store.set(f"connected/{rank}", "1")
    return join(rank, world_size, device, store, expert_parallel, stage_ranks)


def wait_for_workers(
    store: Any, world_size: int, failed: Callable[[], str | None], timeout_s: float, what: str = "tensor parallelism"
) -> None:
    """Rank 0, before joining: wait until every worker reached the store, giving up at once if
    one died on the way (`failed()` returns why) instead of sitting in the group's rendezvous
    until its timeout."""
    keys = [f"connected/{rank}" for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        reason = failed()
        if reason is not None:
            raise RuntimeError(f"{what} could not start: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} workers did not connect within {timeout_s:.0f} s")
        time.sleep(0.05)


def broadcast_object(control: Any, codec: ChannelCodec, obj: Any, rank: int, kind: Any = None) -> Any:
    """Rank 0 sends `obj` (signed), every other rank returns it decoded as `kind`."""
    if rank == 0:
        payload = seal_payload(codec, obj)
        size = torch.tensor([payload.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    control.broadcast(size, 0).wait()
    if rank != 0:
        payload = torch.empty(codec.check_size(int(size.item()), "rank 0"), dtype=torch.uint8)
    control.broadcast(payload, 0).wait()
    return obj if rank == 0 else open_payload(codec, payload, kind, "rank 0")


class Outbox:
    """Point-to-point sends still completing in the background, kept (with their tensors)
    until done: the sender goes on meanwhile."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, control: Any, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._pending = [(work, kept) for work, kept in self._pending if not work.is_completed()]
        self._pending.append((control.send([tensor], peer, tag), tensor))

    def wait(self) -> None:
        """Until every send has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


def seal_payload(codec: ChannelCodec, obj: Any) -> torch.Tensor:
    """`obj` encoded and signed, as a tensor to send."""
    return torch.frombuffer(bytearray(codec.seal(obj)), dtype=torch.uint8)


def forward_payload(outbox: Outbox, control: Any, payload: torch.Tensor, peer: int, tag: int) -> None:
    """Send an already sealed message (as received by `recv_payload`) on to `peer`."""
    outbox.send(control, torch.tensor([payload.numel()], dtype=torch.long), peer, tag)
    outbox.send(control, payload, peer, tag)


def recv_payload(control: Any, codec: ChannelCodec, peer: int, tag: int) -> torch.Tensor:
    """The next sealed message `peer` sent with `tag`, still sealed (its size checked first)."""
    size = torch.zeros(1, dtype=torch.long)
    control.recv([size], peer, tag).wait()
    payload = torch.empty(codec.check_size(int(size.item()), f"rank {peer}"), dtype=torch.uint8)
    control.recv([payload], peer, tag).wait()
    return payload


def open_payload(codec: ChannelCodec, payload: torch.Tensor, kind: Any, sender: str) -> Any:
    """The `kind` a sealed payload holds (RejectedMessage for anything else)."""
    return codec.open(payload.numpy().tobytes(), kind, sender)


def share_payload(stage: Any, codec: ChannelCodec, payload: torch.Tensor | None, local_rank: int) -> torch.Tensor:
    """The stage's lead (local rank 0) hands a sealed message to the stage's other ranks."""
    if local_rank == 0:
        assert payload is not None, "the stage's lead shares the message it received"
        stage.broadcast(torch.tensor([payload.numel()], dtype=torch.long), 0).wait()
    else:
        size = torch.tensor([0], dtype=torch.long)
        stage.broadcast(size, 0).wait()
        payload = torch.empty(codec.check_size(int(size.item()), "the stage's lead"), dtype=torch.uint8)
    stage.broadcast(payload, 0).wait()
    return payload
