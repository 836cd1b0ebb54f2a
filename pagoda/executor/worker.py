"""A worker beside the engine core: a tensor-parallel rank 1..N-1 or a rank of a pipeline
stage (stages 1..P-1, and stage 0's tensor-parallel ranks beyond the engine core's), each in its
own process (or Ray actor).

A tensor-parallel rank loads its shards of the model, allocates its slice of every KV block
(its KV heads) once rank 0 says how many blocks the pool has, then runs every step rank 0
broadcasts: block copies (copy-on-write), the forward, and the LM head when rank 0 samples this
step (its logits all-gather is a collective every rank joins). A pipeline stage loads its
layers only and allocates their KV; each step it receives the step and the previous stage's
hidden states, runs its layers and sends them on, the last stage sending the logits rows back to
stage 0 (pagoda.executor.pipeline); a stage may itself be a tensor-parallel group.
Neither ever schedules or samples: the scheduler, the sampler, grammars and outputs all live
with rank 0 (stage 0).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_groups import KVCacheGroup
from pagoda.executor.channel import ChannelCodec
from pagoda.executor.group import (
    Endpoint,
    Groups,
    Outbox,
    broadcast_object,
    connect,
    forward_payload,
    open_payload,
    recv_payload,
    share_payload,
)
from pagoda.kernels import resolve_kernels
from pagoda.kernels.attention import BatchLayout
from pagoda.model.decoder import DecoderModel
from pagoda.model.loader import (
    adopt_weights,
    checkpoint_items,
    commit_weights,
    load_model,
    load_model_config,
    stage_weights,
)
from pagoda.model.model_config import ModelConfig
from pagoda.model.pipeline import PipelineStage
from pagoda.quant.kv_cache_dtype import make_kv_cache_format
from pagoda.quant.weight_formats import WeightFormat, make_weight_format
from pagoda.rl.weight_group import DTYPES
from pagoda.worker.paged_model import PagedModel
from pagoda.worker.released_memory import ReleasedMemory, empty_cache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank (decided by rank 0, which resolved the dtype
    for itself). Plain settings only (pagoda.executor.channel encodes it): the worker resolves
    its weight format and native kernels from the config, as rank 0 did."""

    config: EngineConfig
    rank: int
    world_size: int
    endpoint: Endpoint
    device: str
    dtype: torch.dtype
    num_threads: int
    startup_timeout_s: float
    channel_secret: bytes  # signs the control messages (pagoda.executor.channel)
    stage: PipelineStage | None = None  # pipeline parallelism: the stage this worker belongs to

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage (its tensor-parallel group)."""
        return self.config.tensor_parallel_size

    @property
    def title(self) -> str:
        """How logs and errors name this worker."""
        if self.stage is None:
            return f"tensor-parallel worker rank {self.rank}"
        if self.stage_ranks == 1:
            return f"pipeline stage {self.stage.index}"
        return f"pipeline stage {self.stage.index} (tensor-parallel rank {self.rank % self.stage_ranks})"


@dataclass(frozen=True)
class KVSetup:
    """Sent once by rank 0 after its own pool is sized: every rank has the same block ids."""

    num_blocks: int
    kv_groups: list[KVCacheGroup]  # rank 0's KV cache groups: the block tables every rank reads


@dataclass
class StepInputs:
    """One forward, as rank 0 flattened it (tensors on the host)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    layouts: list[BatchLayout]  # one per KV cache group
    logit_rows: list[int]
    block_copies: list[tuple[int, int]]


@dataclass
class WeightsRound:
    """A weight update's round (engine/weight_updates.py): "stage" `model_path` (each rank its
    shard, then every rank's outcome summed in `agree_staged`), "stage_streamed" (the tensors
    `names`, `dtypes` and `shapes` announce follow as broadcasts from rank 0, which received them
    from the trainer; each rank stages its shard of each), "reload" `model_path` (weights that
    sleep dropped, adopted whole on commit), "commit" or "discard"."""

    action: str
    model_path: str = ""
    names: list[str] = dataclasses.field(default_factory=list)
    dtypes: list[str] = dataclasses.field(default_factory=list)
    shapes: list[list[int]] = dataclasses.field(default_factory=list)


@dataclass
class SleepRound:
    """Sleep mode on every rank (engine/sleep_mode.py): "sleep" releases the KV pool and at
    `level` 2 the weights (dropped on the CPU with `drop_weights`, reloaded by a "reload" weights
    round before the wake); "wake" gives the memory back."""

    action: str
    level: int = 1
    drop_weights: bool = False


@dataclass
class RankMessage:
    """What rank 0 broadcasts to tensor-parallel workers after setup: a step, a weights round or
    a sleep round (the stop is None)."""

    step: StepInputs | None = None
    weights: WeightsRound | None = None
    sleep: SleepRound | None = None


@dataclass(frozen=True)
class StageMessage:
    """What passes down the chain of pipeline stages: a step, the busy query (stage 0 asks every
    stage for the seconds it has spent computing so far), or, with neither, the stop."""

    step: StepInputs | None = None
    busy_query: bool = False


# Tags of the point-to-point messages between pipeline stages.
HIDDEN_TAG = 1
LOGITS_TAG = 2
BUSY_TAG = 3
STEP_TAG = 4  # a sealed StageMessage, passed down the chain


def layout_to(layout: BatchLayout, device: torch.device) -> BatchLayout:
    """The layout with its tensors on `device`."""
    moved = {
        f.name: getattr(layout, f.name).to(device)
        for f in dataclasses.fields(layout)
        if isinstance(getattr(layout, f.name), torch.Tensor)
    }
    return dataclasses.replace(layout, **moved)


def run_worker(spec: WorkerSpec) -> None:
    """Build rank `spec.rank` and serve steps until rank 0 sends the stop (None)."""
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    config = spec.config
    groups = connect(
        spec.rank,
        spec.world_size,
        device,
        spec.endpoint,
        spec.startup_timeout_s,
        config.enable_expert_parallel,
        spec.stage_ranks if spec.stage is not None else None,
    )
    codec = ChannelCodec(spec.channel_secret)
    model_config = load_model_config(config.model, config.score_tokens, config.tokenizer)
    kernels = resolve_kernels(device, config.native_kernels)  # this process's own, for its device
    weight_format = make_weight_format(
        config.quantization, config.quantization_group_size, config.quantization_zero_point, kernels.native_layout
    )
    model = load_model(config.model, model_config, spec.dtype, device, weight_format, groups.model, spec.stage, kernels)
    setup: KVSetup = broadcast_object(groups.control, codec, None, spec.rank, KVSetup)
    kv_format = make_kv_cache_format(config.kv_cache_dtype, spec.dtype)
    backend = kernels.attention_backend(config.attention_backend, kv_format)
    paged = PagedModel(
        model, backend, setup.num_blocks, config.block_size, spec.dtype, device, kv_format, setup.kv_groups
    )
    if spec.stage is not None:
        logger.info(
            "%s of %d ready: layers %d-%d, %d threads",
            spec.title,
            spec.stage.num_stages,
            spec.stage.first_layer,
            spec.stage.end_layer - 1,
            spec.num_threads,
        )
        serve_stage(
            paged, spec.stage, groups, codec, spec.rank % spec.stage_ranks, spec.stage_ranks, device, spec.dtype
        )
        return
    logger.info(
        "tensor-parallel rank %d/%d ready: %d KV heads, %d threads",
        spec.rank,
        spec.world_size,
        model.num_kv_heads,
        spec.num_threads,
    )
    staged: tuple[DecoderModel, bool] | None = None  # a weight update's shard (and whether it is adopted whole)
    released = ReleasedMemory()  # what sleep mode released
    while True:
        message: RankMessage | None = broadcast_object(groups.control, codec, None, spec.rank, RankMessage | None)
        if message is None:
            return
        if message.step is not None:
            run_step(paged, message.step, device)
        elif message.weights is not None:
            staged = weights_round(
                message.weights, model, staged, groups, model_config, spec.dtype, device, weight_format
            )
        elif message.sleep is not None:
            sleep_round(message.sleep, paged, released, device)


def weights_round(
    message: WeightsRound,
    model: DecoderModel,
    staged: tuple[DecoderModel, bool] | None,
    groups: Groups,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: WeightFormat,
) -> tuple[DecoderModel, bool] | None:
    """A worker's part of a weight update: stage its shard (and report the outcome to the
    other ranks), commit it, or drop it; returns what stays staged."""
    if message.action in ("stage", "stage_streamed", "reload"):
        # Streamed tensors are received whatever happens next: rank 0 broadcasts every one.
        received = receive_streamed(groups.control, message) if message.action == "stage_streamed" else None
        try:
            items = (
                checkpoint_items(message.model_path)
                if received is None
                else (("trainer", name, tensor, None) for name, tensor in received.items())
            )
            fresh = stage_weights(
                model,
                items,
                model_config,
                dtype,
                device,
                weight_format,
                message.model_path or "trainer",
                groups.model,
                check_layout=message.action != "reload",
            )
            staged = (fresh, message.action == "reload")
        except (ValueError, OSError) as error:
            logger.error("rank %d could not stage new weights: %s", groups.model.rank, error)
            staged = None
        agree_staged(groups.control, staged is not None)
        return staged
    if message.action == "commit" and staged is not None:
        fresh, adopt = staged
        if adopt:
            adopt_weights(model, fresh)
        else:
            commit_weights(model, fresh)
    return None


def receive_streamed(control: Any, message: WeightsRound) -> dict[str, torch.Tensor]:
    """The tensors rank 0 relays from the trainer, as the round announced them (each allocated
    from its announcement: nothing else crosses)."""
    received = {}
    for name, dtype, shape in zip(message.names, message.dtypes, message.shapes):
        tensor = torch.empty(shape, dtype=DTYPES[dtype])
        control.broadcast(tensor, 0).wait()
        received[name] = tensor
    return received


def sleep_round(message: SleepRound, paged: PagedModel, released: ReleasedMemory, device: torch.device) -> None:
    """A worker's part of sleep mode: release its KV slice (and weights at level 2), or restore."""
    if message.action == "sleep":
        released.release_kv([t for pair in paged.distinct_kv_caches for t in pair])
        if message.level == 2:
            released.release_weights(paged.model, device, message.drop_weights)
        empty_cache(device)
    elif message.action == "wake":
        released.restore()


def agree_staged(control: Any, staged: bool) -> int:
    """Every rank's staging outcome, summed over the control group: the ranks that failed."""
    failures = torch.tensor([0 if staged else 1], dtype=torch.long)
    control.allreduce([failures]).wait()
    return int(failures.item())


def serve_stage(
    paged: PagedModel,
    stage: PipelineStage,
    groups: Groups,
    codec: ChannelCodec,
    local_rank: int,
    stage_ranks: int,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """A pipeline stage's loop, one StageMessage at a time: a step (its layers between the hidden
    states received from the previous stage and those sent to the next, or the logits sent to
    stage 0), the busy query (answered with its compute seconds so far), or the stop.

    The stage's lead (its tensor-parallel rank 0) receives each message from the previous
    stage's lead and passes it down the chain first; sends complete in the background, so the
    stage takes the next step while the next stage works on this one. With tensor parallelism
    inside the stage, the lead shares the message and the hidden states with the stage's other
    ranks (stage 0's are fed by the engine core), and they all run the layers together."""
    lead = local_rank == 0
    previous, following = (stage.index - 1) * stage_ranks, (stage.index + 1) * stage_ranks
    control = groups.control
    busy_s = 0.0
    host = torch.device("cpu")
    hidden_size = paged.model.config.hidden_size
    outbox = Outbox()
    while True:
        payload = None
        if lead:
            payload = recv_payload(control, codec, previous, STEP_TAG)
            if not stage.is_last:
                forward_payload(outbox, control, payload, following, STEP_TAG)
        if groups.stage is not None:
            payload = share_payload(groups.stage, codec, payload, local_rank)
        assert payload is not None, "ranks besides the lead are in a stage group, whose lead shares the message"
        received_message: StageMessage = open_payload(codec, payload, StageMessage, f"rank {previous}")
        if received_message.busy_query:
            if lead:
                outbox.send(control, torch.tensor([busy_s], dtype=torch.float64), 0, BUSY_TAG)
            continue
        message = received_message.step
        if message is None:
            outbox.wait()
            return
        received = None
        if not stage.is_first:
            received = torch.empty(message.input_ids.numel(), hidden_size, dtype=dtype)
            if lead:
                control.recv([received], previous, HIDDEN_TAG).wait()
            if groups.stage is not None:
                groups.stage.broadcast(received, 0).wait()
            received = received.to(device)
        started = time.perf_counter()
        with torch.inference_mode():
            copy_blocks(paged.distinct_kv_caches, message.block_copies, device)
            context = paged.forward_context([layout_to(layout, device) for layout in message.layouts])
            hidden = paged.model(message.input_ids.to(device), message.positions.to(device), context, received)
            outgoing = None
            if not stage.is_last:
                outgoing, peer, tag = hidden, following, HIDDEN_TAG
            elif message.logit_rows:  # every rank of the stage joins the logits all-gather
                outgoing, peer, tag = paged.model.compute_logits(hidden[message.logit_rows]), 0, LOGITS_TAG
        busy_s += time.perf_counter() - started
        if lead and outgoing is not None:
            outbox.send(control, outgoing.to(host).contiguous(), peer, tag)


@torch.inference_mode()
def run_step(paged: PagedModel, step: StepInputs, device: torch.device) -> None:
    copy_blocks(paged.distinct_kv_caches, step.block_copies, device)
    context = paged.forward_context([layout_to(layout, device) for layout in step.layouts])
    hidden = paged.model(step.input_ids.to(device), step.positions.to(device), context)
    if step.logit_rows:  # rank 0 samples: join the logits all-gather
        paged.model.compute_logits(hidden[step.logit_rows])


def copy_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]], device: torch.device
) -> None:
    """Copy-on-write block copies (src, dst), as rank 0's runner does them."""
    if not copies:
        return
    src = torch.tensor([c[0] for c in copies], device=device)
    dst = torch.tensor([c[1] for c in copies], device=device)
    for key_cache, value_cache in kv_caches:
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
