"""Falcon-H1: every layer runs a Mamba2 mixer (pagoda.model.mamba2) and attention side by side on
the same normed input and adds both to the residual stream, then a gated MLP; with muP
multipliers: the embedding's and the logits', the mixer's input and each part of its projection
(z, x, B, C, dt), its output, attention's input and output and its keys (folded into the
attention scale), and the MLP's gate and down projection. Its own layer class over the shared
pieces; every layer keeps KV and a recurrent state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.decoder import Attention, DecoderModel, ForwardContext
from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagoda.model.linear_attention_config import Mamba2Config
from pagoda.model.mamba2 import Mamba2Mixer
from pagoda.model.mlp import GatedActivation
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import TensorParallelGroup
from pagoda.quant.weight_formats import WeightFormat


def _float(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def read_config(hf: HFConfig) -> ModelConfig:
    config = hf.decoder()
    hidden = config.hidden_size
    heads = int(hf.get("mamba_n_heads") or 128)
    inner = int(hf.get("mamba_d_ssm") or int(hf.get("mamba_expand") or 2) * hidden)
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    multipliers = [float(m) for m in hf.get("ssm_multipliers") or (1.0,) * 5]
    mamba = Mamba2Config(
        layers=(True,) * config.num_layers,
        num_heads=heads,
        head_dim=int(hf.get("mamba_d_head") or inner // heads),
        state_size=int(hf.get("mamba_d_state") or 256),
        num_groups=int(hf.get("mamba_n_groups") or 1),
        conv_kernel_size=int(hf.get("mamba_d_conv") or 4),
        chunk_size=int(hf.get("mamba_chunk_size") or 256),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        time_step_limit=(_float(limit[0]), _float(limit[1])),
        gated_norm=("before_gate" if hf.get("mamba_norm_before_gate", True) else "after_gate")
        if hf.get("mamba_rms_norm", False)
        else "none",
        in_multiplier=float(hf.get("ssm_in_multiplier") or 1.0),
        projection_multipliers=(multipliers[0], multipliers[1], multipliers[2], multipliers[3], multipliers[4]),
    )
    embedding = float(hf.get("embedding_multiplier") or 1.0)
    logits = float(hf.get("lm_head_multiplier") or 1.0)
    return replace(
        config,
        linear_attention=mamba,
        attention_beside_recurrent=True,
        embedding_scale=None if embedding == 1.0 else embedding,
        logits_divisor=None if logits == 1.0 else 1.0 / logits,
        attention_scale=config.head_dim**-0.5 * float(hf.get("key_multiplier") or 1.0),
        layer_multipliers={
            "attention_in": float(hf.get("attention_in_multiplier") or 1.0),
            "attention_out": float(hf.get("attention_out_multiplier") or 1.0),
            "ssm_out": float(hf.get("ssm_out_multiplier") or 1.0),
            "mlp": tuple(float(m) for m in hf.get("mlp_multipliers") or (1.0, 1.0)),
        },
    )


class FalconH1MLP(nn.Module):
    """down(act(gate(x) * g) * up(x)) * d, gate and up fused as checkpoints' gate_proj, up_proj."""

    def __init__(
        self,
        config: ModelConfig,
        multipliers: tuple[float, float],
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(
            hidden,
            2 * inner,
            config.mlp_bias,
            dtype,
            device,
            weight_format,
            tp.column(hidden, inner, inner),
            kernels=kernels,
        )
        self.down_proj = Linear(inner, hidden, config.mlp_bias, dtype, device, weight_format, kernels=kernels)
        self.activation = GatedActivation(config.hidden_activation, None, 1.702)
        self.gate_multiplier, self.down_multiplier = multipliers
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inner, dim=-1)
        return self.down_proj(self.activation(gate * self.gate_multiplier, up)) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        multipliers: dict[str, Any],
        layer_index: int,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        if tp.world_size > 1:
            raise ValueError("tensor parallelism is not supported for Falcon-H1 yet")
        mamba = config.linear_attention
        assert isinstance(mamba, Mamba2Config), "every Falcon-H1 layer has a Mamba2 mixer"
        norm_args = (config.hidden_size, config.rms_norm_eps, dtype, device, False, kernels)
        self.input_layernorm = RMSNorm(*norm_args)
        self.pre_ff_layernorm = RMSNorm(*norm_args)
        self.mamba = Mamba2Mixer(
            mamba, config.hidden_size, config.rms_norm_eps, layer_index, dtype, device, weight_format, tp, kernels
        )
        self.self_attn = Attention(config, layer_index, dtype, device, weight_format, tp, kernels)
        self.feed_forward = FalconH1MLP(config, multipliers["mlp"], dtype, device, weight_format, tp, kernels)
        self.attention_in, self.attention_out = multipliers["attention_in"], multipliers["attention_out"]
        self.ssm_out = multipliers["ssm_out"]

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm.open_block(hidden, residual)
        mixed = self.mamba(normed, context.linear_states) * self.ssm_out
        attended = self.self_attn(normed * self.attention_in, rope, rotary, context) * self.attention_out
        hidden, residual = self.pre_ff_layernorm(mixed + attended, residual)
        return self.feed_forward(hidden), residual


class FalconH1Model(DecoderModel):
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
        return FalconH1Layer(config, config.layer_multipliers, layer_index, dtype, device, weight_format, tp, kernels)


def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
    for file_name, name, tensor, codes in items:  # the final norm is `final_layernorm`
        yield file_name, name.replace("model.final_layernorm.", "model.norm."), tensor, codes


def checkpoint_names(names: list[str]) -> list[str]:
    return [name.replace("model.norm.", "model.final_layernorm.") for name in names]


FAMILY = ModelFamily(
    read_config=read_config,
    checkpoint_tensors=checkpoint_tensors,
    checkpoint_names=checkpoint_names,
    model_class=FalconH1Model,
)
