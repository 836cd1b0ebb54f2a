"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 layers (pagoda.model.mamba2) beside a few
attention layers (`layer_types`: "mamba" / "linear_attention" or "attention" / "full_attention"),
attention without rotary when `position_embedding_type` is not "rope", Granite's multipliers (the
embedding's, each block's output before the residual add, the attention scale, the logits'
divisor), and an MLP of routed experts (softmax over the top-k logits) plus an ungated shared MLP
(`shared_mlp`), or the shared MLP alone when the config has no experts.

Checkpoint names: `block_sparse_moe.router.layer` is the MoE block's router (pagoda's `mlp.gate`),
its `input_linear` / `output_linear` the routed experts' gate|up and down projections stacked
[E, ...] (transformers 5's in-memory `router` and `experts` are read too), and
`shared_mlp.input_linear` / `output_linear` the shared expert's fused gate|up and down
projections (the MLP's own without experts)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.linear_attention_config import Mamba2Config
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe_config import MoEConfig

_RECURRENT = ("mamba", "linear_attention")


def _mamba(hf: HFConfig, num_layers: int) -> Mamba2Config | None:
    layer_types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers
    layers = tuple(t in _RECURRENT for t in layer_types)
    if len(layers) != num_layers:
        raise ValueError(f"{hf.source}: layer_types names {len(layers)} layers, num_hidden_layers {num_layers}")
    if not any(layers):
        return None
    hidden = hf.required_int("hidden_size")
    heads = int(hf.get("mamba_n_heads") or 128)
    inner = int(hf.get("mamba_expand") or 2) * hidden
    head_dim = hf.get("mamba_d_head")
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Config(
        layers=layers,
        num_heads=heads,
        head_dim=inner // heads if head_dim in (None, "auto") else int(head_dim),
        state_size=int(hf.get("mamba_d_state") or 256),
        num_groups=int(hf.get("mamba_n_groups") or 1),
        conv_kernel_size=int(hf.get("mamba_d_conv") or 4),
        chunk_size=int(hf.get("mamba_chunk_size") or 256),
        conv_bias=bool(hf.get("mamba_conv_bias", True)),
        proj_bias=bool(hf.get("mamba_proj_bias", False)),
        time_step_limit=(_float(limit[0]), _float(limit[1])),
    )


def _float(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def read_config(hf: HFConfig) -> ModelConfig:
    num_experts = int(hf.get("num_local_experts") or 0)
    shared = int(hf.get("shared_intermediate_size") or 0)
    # The dense MLP is the shared one; the experts' size is `intermediate_size`.
    values = {**hf.values, "intermediate_size": shared} if not num_experts else hf.values
    decoder_hf = replace(hf, values=values)
    config = decoder_hf.decoder()
    num_layers = config.num_layers
    moe = None
    if num_experts:
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=int(hf.get("num_experts_per_tok") or 1),
            intermediate_size=hf.required_int("intermediate_size"),
            renormalize=False,
            shared_expert_intermediate_size=shared,
            sparse_layers=(True,) * num_layers,
            softmax_over_top_k=True,
            shared_expert_gated=False,
        )
    multiplier = hf.get("embedding_multiplier")
    logits_scaling = hf.get("logits_scaling")
    residual = hf.get("residual_multiplier")
    attention = hf.get("attention_multiplier")
    return replace(
        config,
        linear_attention=_mamba(hf, num_layers),
        moe=moe,
        embedding_scale=None if multiplier in (None, 1.0) else float(multiplier),
        residual_multiplier=None if residual in (None, 1.0) else float(residual),
        attention_scale=None if attention is None else float(attention),
        logits_divisor=None if logits_scaling in (None, 1.0) else float(logits_scaling),
        no_rope=hf.get("position_embedding_type") != "rope",
    )


_TO_PAGODA = [
    # as saved: the router's `layer`, every expert's gate|up and down stacked [E, ...]
    (re.compile(r"\.block_sparse_moe\.router\.layer\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".mlp.experts.gate_up_proj"),
    (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".mlp.experts.down_proj"),
    # transformers 5's in-memory names
    (re.compile(r"\.block_sparse_moe\.router\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.experts\."), ".mlp.experts."),
]


def _renamer(has_experts: bool) -> list[tuple[re.Pattern, str]]:
    shared = ".mlp.shared_expert." if has_experts else ".mlp."
    return [
        *_TO_PAGODA,
        (re.compile(r"\.shared_mlp\.input_linear\."), shared + "gate_up_proj."),
        (re.compile(r"\.shared_mlp\.output_linear\."), shared + "down_proj."),
    ]


def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
    # A checkpoint with experts names its router; the shared MLP is then the MoE block's shared expert.
    buffered = list(items)
    renames = _renamer(any(".block_sparse_moe." in name for _, name, _, _ in buffered))
    for file_name, name, tensor, codes in buffered:
        for pattern, replacement in renames:
            name = pattern.sub(replacement, name)
        yield file_name, name, tensor, codes


def checkpoint_names(names: list[str]) -> list[str]:
    spelled = []
    for name in names:
        name = name.replace(".mlp.gate.", ".block_sparse_moe.router.layer.")
        name = re.sub(r"\.mlp\.experts\.\d+\.gate_up_proj\.weight$", ".block_sparse_moe.input_linear.weight", name)
        name = re.sub(r"\.mlp\.experts\.\d+\.down_proj\.weight$", ".block_sparse_moe.output_linear.weight", name)
        name = name.replace(".mlp.shared_expert.gate_up_proj.", ".shared_mlp.input_linear.")
        name = name.replace(".mlp.shared_expert.down_proj.", ".shared_mlp.output_linear.")
        name = name.replace(".mlp.gate_up_proj.", ".shared_mlp.input_linear.")
        name = name.replace(".mlp.down_proj.", ".shared_mlp.output_linear.")
        spelled.append(name)
    return spelled


FAMILY = ModelFamily(read_config=read_config, checkpoint_tensors=checkpoint_tensors, checkpoint_names=checkpoint_names)
