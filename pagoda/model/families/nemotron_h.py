"""Nemotron-H (dense): a stack of single-mixer blocks, each an RMSNorm and one of a Mamba2 mixer
(pagoda.model.mamba2), attention without rotary, or an MLP of up and down projections with a
squared ReLU (`layers_block_type`, or the older `hybrid_override_pattern` of M, *, -), added to
the residual stream. Its own block class over the shared pieces; the MoE blocks (E) of the
larger models are refused. Checkpoints name the stack `backbone` (`embeddings`, `norm_f`), and
each block's `norm` and `mixer`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.decoder import Attention, DecoderModel, ForwardContext
from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagoda.model.linear_attention_config import Mamba2Config
from pagoda.model.mamba2 import Mamba2Mixer
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.quant.weight_formats import WeightFormat

_MAMBA, _ATTENTION, _MLP = "linear_attention", "full_attention", "mlp"
_PATTERN = {"M": _MAMBA, "*": _ATTENTION, "-": _MLP, "E": "moe"}


def _block_types(hf: HFConfig) -> list[str]:
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError(f"{hf.source}: neither layers_block_type nor hybrid_override_pattern")
        types = [_PATTERN[c] for c in pattern]
    types = [{"mamba": _MAMBA, "attention": _ATTENTION}.get(t, t) for t in types]
    unknown = sorted({t for t in types if t not in (_MAMBA, _ATTENTION, _MLP)})
    if unknown and hf.require_supported:
        raise ValueError(f"{hf.source}: Nemotron-H blocks of type {', '.join(unknown)} are not supported yet")
    return types


def _float(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def read_config(hf: HFConfig) -> ModelConfig:
    types = _block_types(hf)
    values = {
        **hf.values,
        "num_hidden_layers": len(types),
        "rms_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        # the shared MLP's activation is not used: this family's blocks have their own MLP
        "hidden_act": "silu",
    }
    activation = hf.get("mlp_hidden_act") or "relu2"
    if activation != "relu2" and hf.require_supported:
        raise ValueError(f"{hf.source}: mlp_hidden_act {activation!r} is not supported (relu2)")
    hf = replace(hf, values=values)
    config = hf.decoder()
    heads = int(hf.get("mamba_num_heads") or 128)
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    mamba = Mamba2Config(
        layers=tuple(t == _MAMBA for t in types),
        num_heads=heads,
        head_dim=int(hf.get("mamba_head_dim") or 64),
        state_size=int(hf.get("ssm_state_size") or 128),
        num_groups=int(hf.get("n_groups") or 8),
        conv_kernel_size=int(hf.get("conv_kernel") or 4),
        chunk_size=int(hf.get("chunk_size") or 128),
        conv_bias=bool(hf.get("use_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        time_step_limit=(_float(limit[0]), _float(limit[1])),
    )
    return replace(
        config,
        linear_attention=mamba if any(mamba.layers) else None,
        mlp_only_layers=tuple(i for i, t in enumerate(types) if t == _MLP),
        no_rope=True,
        hidden_activation=activation,
    )


class SquaredReLUMLP(nn.Module):
    """down(relu(up(x))^2); `up` is the checkpoints' `up_proj` (renamed: pagoda's loader fuses
    an `up_proj` with a gate)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        self.up = Linear(hidden, intermediate, bias, dtype, device, weight_format, kernels=kernels)
        self.down_proj = Linear(intermediate, hidden, bias, dtype, device, weight_format, kernels=kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up(x))))


class NemotronHBlock(nn.Module):
    """norm, then one mixer, added to the residual stream (folded into the next norm)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        if tp.world_size > 1:
            raise ValueError("tensor parallelism is not supported for Nemotron-H yet")
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, False, kernels)
        mamba = config.linear_attention
        self.mixer: nn.Module
        if isinstance(mamba, Mamba2Config) and mamba.layers[layer_index]:
            self.mixer = Mamba2Mixer(
                mamba, config.hidden_size, config.rms_norm_eps, layer_index, dtype, device, weight_format, tp, kernels
            )
        elif layer_index in config.mlp_only_layers:
            self.mixer = SquaredReLUMLP(
                config.hidden_size, config.intermediate_size, config.mlp_bias, dtype, device, weight_format, kernels
            )
        else:
            self.mixer = Attention(config, layer_index, dtype, device, weight_format, tp, kernels)

    @property
    def self_attn(self) -> Attention | None:
        """The block's attention, where it has one (what the KV cache and the backend look for)."""
        return self.mixer if isinstance(self.mixer, Attention) else None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.norm.open_block(hidden, residual)
        if isinstance(self.mixer, Attention):
            return self.mixer(normed, rope, rotary, context), residual
        if isinstance(self.mixer, Mamba2Mixer):
            return self.mixer(normed, context.linear_states), residual
        return self.mixer(normed), residual


class NemotronHModel(DecoderModel):
    def build_layer(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
    ) -> nn.Module:
        return NemotronHBlock(config, layer_index, dtype, device, weight_format, tp, kernels)


_RENAMES = [
    (re.compile(r"^backbone\."), "model."),
    (re.compile(r"^model\.embeddings\."), "model.embed_tokens."),
    (re.compile(r"^model\.norm_f\."), "model.norm."),
    (re.compile(r"\.mixer\.up_proj\."), ".mixer.up."),
]


def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
    for file_name, name, tensor, codes in items:
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        yield file_name, name, tensor, codes


def checkpoint_names(names: list[str]) -> list[str]:
    spelled = []
    for name in names:
        name = re.sub(r"^model\.embed_tokens\.", "backbone.embeddings.", name)
        name = re.sub(r"^model\.norm\.", "backbone.norm_f.", name)
        name = re.sub(r"^model\.", "backbone.", name).replace(".mixer.up.", ".mixer.up_proj.")
        spelled.append(name.replace(".mixer.qkv_proj.", ".mixer.q_proj|k_proj|v_proj."))
    return spelled


FAMILY = ModelFamily(
    read_config=read_config,
    checkpoint_tensors=checkpoint_tensors,
    checkpoint_names=checkpoint_names,
    model_class=NemotronHModel,
)
