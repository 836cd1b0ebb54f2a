"""Mixtral: Mistral's decoder (a sliding window on every layer) with a sparse MoE block in every
layer: `num_local_experts` experts of `intermediate_size`, top-k routing renormalized.

Its checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3
(up), w2 (down): renamed to pagoda's (the Qwen-MoE names) as they load. llama.cpp writes it as
the `llama` GGUF architecture with experts (pagoda.model.families.llama reads the file and
`with_gguf_experts` its experts).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.hf_config import HFConfig, window_on_every_layer
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe_config import MoEConfig, expert_routing
from pagoda.quant.gguf_checkpoint import GGUFCheckpoint
from pagoda.quant.gguf_moe import read_experts

_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])\.)?")


def _experts(hf: HFConfig, num_layers: int) -> MoEConfig | None:
    routing = expert_routing(hf.values, hf.source)
    if routing is None:
        return None
    num_experts, top_k = routing
    return MoEConfig(num_experts, top_k, hf.required_int("intermediate_size"), True, 0, (True,) * num_layers)


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(sliding_windows=window_on_every_layer, moe=_experts)


def with_gguf_experts(checkpoint: GGUFCheckpoint, config: dict[str, Any]) -> dict[str, Any]:
    """A `llama` GGUF's config with its experts: a Mixtral's."""
    experts = read_experts(
        checkpoint.path, checkpoint.architecture, checkpoint.arch_value, checkpoint.tensors, config["num_hidden_layers"]
    )
    if not all(experts.sparse_layers):
        raise ValueError(
            f"{checkpoint.path}: layer {experts.sparse_layers.index(False)} has no router "
            f"(blk.N.ffn_gate_inp); Mixtral GGUFs have experts in every layer"
        )
    return {
        **config,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": experts.num_experts,
        "num_experts_per_tok": experts.top_k,
    }


def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
    for file_name, name, tensor, int4_codes in items:
        yield file_name, _EXPERT.sub(_to_pagoda, name), tensor, int4_codes


def _to_pagoda(match: re.Match) -> str:
    expert, projection = match.groups()
    return ".mlp." if expert is None else f".mlp.experts.{expert}.{_NAMES[projection]}."


def checkpoint_names(names: list[str]) -> list[str]:
    """pagoda's names as Mixtral's checkpoints spell them."""
    spelled = []
    for name in names:
        expert = re.match(r"^(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(.*)$", name)
        if expert is not None:
            prefix, index, projection, rest = expert.groups()
            w = {v: k for k, v in _NAMES.items()}[projection]
            spelled.append(f"{prefix}.block_sparse_moe.experts.{index}.{w}.{rest}")
        else:
            spelled.append(name.replace(".mlp.gate.", ".block_sparse_moe.gate."))
    return spelled


FAMILY = ModelFamily(read_config=read_config, checkpoint_tensors=checkpoint_tensors, checkpoint_names=checkpoint_names)
