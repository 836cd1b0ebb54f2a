"""gpt-oss: the shared decoder with attention sinks (a learned logit per head joins each
softmax's denominator), YaRN rope (base 150000 where the config names none), and a sparse MoE
block in every layer: `num_local_experts` biased experts of `intermediate_size` behind a biased
router whose softmax runs over the chosen experts only, with the clamped SwiGLU (`swiglu_limit`,
`swiglu_alpha`).

Its checkpoint tensors become pagoda's per-expert names as they load. transformers saves a
layer's experts fused: `experts.gate_up_proj` [E, H, 2I] (input-major, gate and up
interleaved: even columns gate, odd up), `experts.gate_up_proj_bias` [E, 2I],
`experts.down_proj` [E, I, H] and `experts.down_proj_bias` [E, H]; the Hub's checkpoints hold
the two weights as MXFP4 `*_blocks` / `*_scales` in output-major order ([E, 2I, H] and
[E, H, I] once dequantized, pagoda.quant.mxfp4). The router is `mlp.router`. Each becomes one
tensor per expert, `experts.{e}.gate_up_proj.weight` [2I, H] with the gate rows before the up
rows (as every gated MLP in pagoda), its bias likewise, and `experts.{e}.down_proj.*`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from pagoda.model.families.base import CheckpointItem as Item
from pagoda.model.families.base import ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe_config import MoEConfig, expert_routing
from pagoda.quant.mxfp4 import dequantize_mxfp4

_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
# pagoda's name of one expert's tensor, gate and up as the loader expects them (apart or fused)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_up|gate|up|down)_proj\.(weight|bias)$")


def gpt_oss_tensors(items: Iterable[Item]) -> Iterator[Item]:
    """(file, name, tensor, int4 codes) items with gpt-oss's router and experts renamed and cut
    per expert; MXFP4 pairs dequantized once both halves have been read."""
    pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for file_name, name, tensor, codes in items:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        fused = _FUSED.match(name)
        if fused is None or tensor is None:
            yield file_name, name, tensor, codes
            continue
        prefix, projection, suffix = fused.groups()
        if suffix in ("_blocks", "_scales"):
            halves = pending.setdefault(f"{prefix}.{projection}", {})
            halves[suffix] = (file_name, tensor)
            if len(halves) == 2:
                del pending[f"{prefix}.{projection}"]
                weight = dequantize_mxfp4(halves["_blocks"][1], halves["_scales"][1], name.removesuffix(suffix))
                yield from _per_expert(file_name, prefix, projection, "weight", weight)
            continue
        if suffix == "_bias":
            yield from _per_expert(file_name, prefix, projection, "bias", tensor)
        else:  # transformers' input-major weight
            yield from _per_expert(file_name, prefix, projection, "weight", tensor.transpose(-1, -2))
    for name, halves in pending.items():
        ((file_name, _),) = halves.values()
        missing = "_scales" if "_blocks" in halves else "_blocks"
        raise ValueError(f"{file_name}: MXFP4 tensor {name}{missing} is missing (its other half is there)")


def _per_expert(file_name: str, prefix: str, projection: str, param: str, tensor: torch.Tensor) -> Iterator[Item]:
    """tensor [E, out, ...] output-major: one item per expert, gate/up de-interleaved."""
    for expert, piece in enumerate(tensor.unbind(0)):
        if projection == "gate_up_proj":
            piece = torch.cat((piece[0::2], piece[1::2]))
        yield file_name, f"{prefix}.{expert}.{projection}.{param}", piece.contiguous(), None


def gpt_oss_checkpoint_names(names: list[str]) -> list[str]:
    """pagoda's names of missing tensors as gpt-oss checkpoints spell them (for error messages):
    each fused expert tensor once."""
    spelled: list[str] = []
    for name in names:
        match = _PER_EXPERT.match(name)
        if match is not None:
            prefix, projection, param = match.groups()
            projection = "down_proj" if projection == "down" else "gate_up_proj"
            name = f"{prefix}.{projection}{'_bias' if param == 'bias' else ''}"
        name = name.replace(".mlp.gate.", ".mlp.router.")
        if name not in spelled:
            spelled.append(name)
    return spelled


def _experts(hf: HFConfig, num_layers: int) -> MoEConfig | None:
    routing = expert_routing(hf.values, hf.source)
    if routing is None:
        return None
    num_experts, top_k = routing
    return MoEConfig(
        num_experts,
        top_k,
        hf.required_int("intermediate_size"),
        True,
        0,
        (True,) * num_layers,
        router_bias=True,
        softmax_over_top_k=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit") or 7.0),
        swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702),
    )


def read_config(hf: HFConfig) -> ModelConfig:
    return hf.decoder(default_rope_theta=150000.0, attention_sinks=True, moe=_experts)


FAMILY = ModelFamily(
    read_config=read_config, checkpoint_tensors=gpt_oss_tensors, checkpoint_names=gpt_oss_checkpoint_names
)
