"""The process group a trainer streams weights over: the trainer is rank 0 and hosts the group's
TCP store; each engine joins at `rank_offset` + its own index. gloo on CPU, NCCL on CUDA. The
group is built from a store directly (no torch.distributed default group), so it lives beside
whatever groups the engine's tensor-parallel ranks already use.

A transfer is a list of (name, dtype, shape), sent first over HTTP, then one broadcast per tensor
from the trainer in that order: every receiver allocates exactly what it was told and nothing
else crosses the group (no pickled objects).
"""

from __future__ import annotations

import collections
import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TRAINER_RANK = 0
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WeightGroupSpec:
    """Where the group meets and who is in it (vLLM's init_weight_update_group arguments)."""

    master_address: str
    master_port: int
    rank_offset: int  # the first engine's rank (the trainer holds the ranks below it)
    world_size: int
    backend: str = "gloo"  # "gloo" or "nccl"
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset must be from 1 to world_size - 1, got {self.rank_offset} "
                f"with world_size {self.world_size}"
            )
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s must be above 0 and at most 3600, got {self.timeout_s}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a transfer, as announced before its broadcast."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"weights travel as {', '.join(DTYPES)}, not {dtype}")


def parse_metas(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorMeta]:
    """SGLang's and vLLM's parallel lists as metas; ValueError when they disagree or name an
    unknown dtype."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes and shapes must be as long as each other, got {len(names)}, {len(dtypes)} and {len(shapes)}"
        )
    metas = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        dtype = dtype.removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape must be non-negative integers, got {shape!r}")
        metas.append(TensorMeta(name, dtype, tuple(shape)))
    return metas


@dataclass
class WeightGroup:
    """A joined group, the store it meets through (kept alive with it) and where its tensors live."""

    backend: Any  # a ProcessGroupGloo or ProcessGroupNCCL
    store: Any
    device: torch.device


def join(spec: WeightGroupSpec, rank: int) -> WeightGroup:
    """This process's view of the group (the trainer, rank 0, hosts the store); returns once
    every rank joined."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, rank == TRAINER_RANK, timeout=timeout)
    prefix = dist.PrefixStore("pagoda-weights", store)
    if spec.backend == "nccl":
        group = WeightGroup(
            dist.ProcessGroupNCCL(prefix, rank, spec.world_size, dist.ProcessGroupNCCL.Options()),
            store,
            torch.device("cuda", torch.cuda.current_device()),
        )
    else:
        group = WeightGroup(dist.ProcessGroupGloo(prefix, rank, spec.world_size, timeout), store, torch.device("cpu"))
    barrier(group)
    return group


def barrier(group: WeightGroup) -> None:
    # A one-element all-reduce: both backends have it, and it works before any other collective.
    group.backend.allreduce([torch.zeros(1, device=group.device)]).wait()


def broadcast(group: WeightGroup, tensors: Iterable[torch.Tensor]) -> None:
    """The trainer's side: each tensor to every rank, in the announced order."""
    for tensor in tensors:
        group.backend.broadcast(tensor.detach().to(group.device).contiguous(), TRAINER_RANK).wait()


def receive(group: WeightGroup, metas: list[TensorMeta]) -> dict[str, torch.Tensor]:
    """An engine's side: the tensors `metas` announced, by name."""
    transfer = Transfer(group, metas)
    try:
        return dict(transfer)
    finally:
        transfer.drain()


class Transfer:
    """An engine's side of a transfer in flight: every broadcast is posted at once (the backend
    receives them in order on its own threads), and iterating yields (name, tensor) as each
    arrives, so the caller fills and packs one tensor while the next ones are received. `drain`
    (always, once done: also after the caller stopped early) waits for what is still arriving,
    so the group stays in step with the trainer and no buffer is freed under a receive."""

    def __init__(
        self,
        group: WeightGroup,
        metas: list[TensorMeta],
        into: list[torch.Tensor | None] | None = None,
        keep: bool = True,
    ) -> None:
        """`into`: for each announced tensor, where to receive it (a contiguous tensor of its
        dtype and shape on the group's device), or None: a buffer of its own. `keep`: hold on to
        every tensor received, in `tensors`."""
        self._pending: collections.deque[tuple[str, torch.Tensor, Any]] = collections.deque()
        for meta, target in zip(metas, into or [None] * len(metas)):
            tensor = target
            if tensor is None or tensor.device != group.device:
                tensor = torch.empty(meta.shape, dtype=DTYPES[meta.dtype], device=group.device)
            self._pending.append((meta.name, tensor, group.backend.broadcast(tensor, TRAINER_RANK)))
        self.keep = keep
        self.tensors: dict[str, torch.Tensor] = {}  # what arrived, by name (with `keep`)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._pending:
            name, tensor, work = self._pending[0]
            work.wait()
            self._pending.popleft()
            if self.keep:
                self.tensors[name] = tensor
            yield name, tensor

    def drain(self) -> None:
        """Wait for every broadcast still in flight (their errors too: the transfer failed)."""
        pending, self._pending = self._pending, collections.deque()
        for _, _, work in pending:
            try:
                work.wait()
            except RuntimeError:
                pass  # the group broke: the caller's own wait raised already
