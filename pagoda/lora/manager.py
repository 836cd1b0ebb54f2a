"""LoRAManager: the loaded adapters of one engine, the model's LoRA layers and their slots.

- Host side (the registry): adapters loaded by name (`add`, `remove`), each with an
  AdapterIdentity that requests carry. An adapter removed while requests still use it stays
  until the last of them is released, but no new request can name it.
- Device side: `wrap_model` replaces each decoder projection with a LoRALinear; before a
  forward, `begin_step` puts the step's adapters into slots (LRU, copying weights on a miss)
  and builds the per-token slot mapping every layer reads; `end_step` clears it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from pagoda.errors import InvalidRequest
from pagoda.lora.adapter import LoRAAdapter, load_peft_adapter
from pagoda.lora.batch import NO_SLOT, LoRAStepState, build_lora_batch
from pagoda.lora.layer import LoRALinear, LoRAPart
from pagoda.lora.slots import SlotTable
from pagoda.lora_request import AdapterIdentity, LoRARequest
from pagoda.model.decoder import DecoderModel


def wrap_model(
    model: DecoderModel,
    state: LoRAStepState,
    *,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[LoRALinear]:
    """Replace every decoder projection by a LoRALinear around it (after loading: the base
    layers keep their parameters and weight formats)."""
    config = model.config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    layout = {
        ("self_attn", "qkv_proj"): [
            LoRAPart("q_proj", 0, q_size),
            LoRAPart("k_proj", q_size, kv_size),
            LoRAPart("v_proj", q_size + kv_size, kv_size),
        ],
        ("self_attn", "o_proj"): [LoRAPart("o_proj", 0, config.hidden_size)],
        ("mlp", "gate_up_proj"): [LoRAPart("gate_proj", 0, inter), LoRAPart("up_proj", inter, inter)],
        ("mlp", "down_proj"): [LoRAPart("down_proj", 0, config.hidden_size)],
    }
    wrapped = []
    layers = model.model.layers
    assert isinstance(layers, nn.ModuleList), "the decoder stack's layers"
    for index, layer in enumerate(layers):
        for (block_name, proj_name), parts in layout.items():
            block = getattr(layer, block_name)
            lora = LoRALinear(
                getattr(block, proj_name),
                index,
                parts,
                max_loras=max_loras,
                max_rank=max_rank,
                state=state,
                dtype=dtype,
                device=device,
            )
            setattr(block, proj_name, lora)
            wrapped.append(lora)
    return wrapped


class LoRAManager:
    def __init__(
        self, model: DecoderModel, *, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_lora_rank}")
        if model.config.moe is not None:  # adapters' MLP deltas would need one slot table per expert
            raise ValueError(
                f"LoRA adapters are not supported on mixture-of-experts models yet ({model.config.architecture})"
            )
        self.model_config = model.config
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.state = LoRAStepState()
        self.layers = wrap_model(
            model, self.state, max_loras=max_loras, max_rank=max_lora_rank, dtype=dtype, device=device
        )
        self.slots = SlotTable(max_loras)
        # The delta's kernels: missing ones are a startup error, never a slow fallback.
        model.kernels.check_lora()
        self._by_name: dict[str, AdapterIdentity] = {}  # servable adapters
        self._adapters: dict[int, LoRAAdapter] = {}  # load id -> weights, removed ones still in use too
        self._identities: dict[int, AdapterIdentity] = {}
        self._users: Counter[int] = Counter()  # load id -> live requests using it
        self._load_ids = itertools.count(1)

    @property
    def max_loras(self) -> int:
        return self.slots.num_slots

    # ---- the registry --------------------------------------------------------------------------

    def add(self, name: str, path: str | Path) -> AdapterIdentity:
        """Load a PEFT adapter under `name`. Raises InvalidRequest (bad adapter, name taken)."""
        if name in self._by_name:
            raise InvalidRequest(
                f"LoRA adapter {name!r} is already loaded", param="lora_name", code="lora_adapter_exists"
            )
        adapter = load_peft_adapter(name, path, self.model_config, max_rank=self.max_lora_rank, dtype=self.dtype)
        identity = AdapterIdentity(name=name, content_hash=adapter.content_hash, load_id=next(self._load_ids))
        self._by_name[name] = identity
        self._adapters[identity.load_id] = adapter
        self._identities[identity.load_id] = identity
        return identity

    def remove(self, name: str) -> None:
        """Unload `name`: new requests cannot use it; running ones finish with it."""
        identity = self._by_name.pop(name, None)
        if identity is None:
            raise unknown_adapter(name)
        self._drop_if_unused(identity.load_id)

    def resolve(self, lora_request: LoRARequest) -> AdapterIdentity:
        """The identity for a request's adapter; offline, a path not loaded yet loads it."""
        identity = self._by_name.get(lora_request.lora_name)
        if identity is None:
            if not lora_request.lora_path:
                raise unknown_adapter(lora_request.lora_name)
            return self.add(lora_request.lora_name, lora_request.lora_path)
        loaded_from = self._adapters[identity.load_id].path
        if lora_request.lora_path and Path(lora_request.lora_path) != Path(loaded_from):
            raise InvalidRequest(
                f"LoRA adapter {lora_request.lora_name!r} is loaded from {loaded_from}, not "
                f"{lora_request.lora_path}; unload it first",
                param="lora_request",
                code="lora_adapter_exists",
            )
        return identity

    def names(self) -> list[str]:
        return list(self._by_name)

    def adapter(self, name: str) -> LoRAAdapter:
        identity = self._by_name.get(name)
        if identity is None:
            raise unknown_adapter(name)
        return self._adapters[identity.load_id]

    def retain(self, identity: AdapterIdentity) -> None:
        self._users[identity.load_id] += 1

    def release(self, identity: AdapterIdentity) -> None:
        self._users[identity.load_id] -= 1
        if self._users[identity.load_id] <= 0:
            del self._users[identity.load_id]
            self._drop_if_unused(identity.load_id)

    def _drop_if_unused(self, load_id: int) -> None:
        identity = self._identities.get(load_id)
        if identity is None or self._users[load_id] > 0 or self._by_name.get(identity.name) == identity:
            return
        del self._adapters[load_id], self._identities[load_id]
        self.slots.evict(load_id)

    # ---- one step ------------------------------------------------------------------------------

    def begin_step(self, token_runs: Sequence[tuple[AdapterIdentity | None, int]]) -> None:
        """Place the step's adapters in slots and publish the token -> slot mapping.
        `token_runs`: (adapter or None, number of tokens) per request, in batch order."""
        load_ids = [identity.load_id for identity, _ in token_runs if identity is not None]
        if not load_ids:
            self.state.batch = None
            return
        slot_of, copies = self.slots.assign(load_ids)
        for load_id, slot in copies:
            adapter = self._adapters[load_id]
            for layer in self.layers:
                layer.load_slot(slot, adapter)
        ranks = {slot_of[load_id]: self._adapters[load_id].rank for load_id in slot_of}
        runs = [(NO_SLOT if identity is None else slot_of[identity.load_id], count) for identity, count in token_runs]
        self.state.batch = build_lora_batch(runs, ranks, self.device)

    def end_step(self) -> None:
        self.state.batch = None


def unknown_adapter(name: str) -> InvalidRequest:
    return InvalidRequest(f"The model `{name}` does not exist.", param="model", code="model_not_found")
