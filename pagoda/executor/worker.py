"""A tensor-parallel worker: ranks 1..N-1, each in its own process (or Ray actor).

It loads its shards of the model, allocates its slice of every KV block (its KV heads) once
rank 0 says how many blocks the pool has, then runs every step rank 0 broadcasts: block copies
(copy-on-write), the forward, and the LM head when rank 0 samples this step (its logits
all-gather is a collective every rank joins). It never schedules or samples: the scheduler,
the sampler, grammars and outputs all live with rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_groups import KVCacheGroup
from pagoda.executor.group import Endpoint, broadcast_object, connect
from pagoda.model.attention import BatchLayout, select_backend
from pagoda.model.loader import load_model, load_model_config
from pagoda.quant.kv_cache_dtype import make_kv_cache_format
from pagoda.quant.weight_formats import WeightFormat
from pagoda.worker.paged_model import PagedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank (decided by rank 0, which resolved dtype
    and weight format the same way for itself)."""

    config: EngineConfig
    rank: int
    world_size: int
    endpoint: Endpoint
    device: str
    dtype: torch.dtype
    weight_format: WeightFormat
    num_threads: int
    startup_timeout_s: float


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


def layout_to(layout: BatchLayout, device: torch.device) -> BatchLayout:
    """The layout with its tensors on `device`."""
    moved = {f.name: getattr(layout, f.name).to(device) for f in dataclasses.fields(layout)
             if isinstance(getattr(layout, f.name), torch.Tensor)}
    return dataclasses.replace(layout, **moved)


def run_worker(spec: WorkerSpec) -> None:
    """Build rank `spec.rank` and serve steps until rank 0 sends the stop (None)."""
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    config = spec.config
    groups = connect(spec.rank, spec.world_size, device, spec.endpoint, spec.startup_timeout_s,
                     config.enable_expert_parallel)
    model_config = load_model_config(config.model)
    model = load_model(config.model, model_config, spec.dtype, device, spec.weight_format, groups.model)
    setup: KVSetup = broadcast_object(groups.control, None, spec.rank)
    kv_format = make_kv_cache_format(config.kv_cache_dtype, spec.dtype)
    backend = select_backend(config.attention_backend, device, kv_format)
    paged = PagedModel(model, backend, setup.num_blocks, config.block_size, spec.dtype, device, kv_format,
                       setup.kv_groups)
    logger.info("tensor-parallel rank %d/%d ready: %d KV heads, %d threads", spec.rank, spec.world_size,
                model.num_kv_heads, spec.num_threads)
    while True:
        step: StepInputs | None = broadcast_object(groups.control, None, spec.rank)
        if step is None:
            return
        run_step(paged, step, device)


@torch.inference_mode()
def run_step(paged: PagedModel, step: StepInputs, device: torch.device) -> None:
    copy_blocks(paged.distinct_kv_caches, step.block_copies, device)
    context = paged.forward_context([layout_to(layout, device) for layout in step.layouts])
    hidden = paged.model(step.input_ids.to(device), step.positions.to(device), context)
    if step.logit_rows:  # rank 0 samples: join the logits all-gather
        paged.model.compute_logits(hidden[step.logit_rows])


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]],
                device: torch.device) -> None:
    """Copy-on-write block copies (src, dst), as rank 0's runner does them."""
    if not copies:
        return
    src = torch.tensor([c[0] for c in copies], device=device)
    dst = torch.tensor([c[1] for c in copies], device=device)
    for key_cache, value_cache in kv_caches:
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
