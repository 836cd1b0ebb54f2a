"""DeepSeek-V3 (and R1, V3.1, Kimi K2: the same architecture): multi-head latent attention
(pagoda.model.mla; the paged cache holds one latent and one rope key per token and layer) and
sparse MoE blocks with DeepSeek's router (pagoda.kernels.moe.SigmoidRouting: sigmoid scores, a
learned correction bias steering the choice, group-limited top-k, routed scaling) and ungated
shared experts, after `first_k_dense_replace` dense layers.

Checkpoint names differ from pagoda's in three places: `self_attn.q_proj` (pagoda's
`query_proj`: the loader fuses `q_proj` into qkv_proj elsewhere), `mlp.shared_experts`
(`shared_expert`) and `mlp.gate.e_score_correction_bias` (the block's own). The multi-token
prediction layers hub checkpoints carry after the decoder (`model.layers.{num_hidden_layers}`...)
are skipped as layers no stage holds, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from pagoda.model.families.base import CheckpointItem, ModelFamily
from pagoda.model.hf_config import HFConfig
from pagoda.model.mla_config import MLAConfig
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe_config import MoEConfig, expert_routing

# (checkpoint's, pagoda's): the MoE block's names DeepSeek's and GLM-4.5's checkpoints share,
# then the latent attention's query.
MOE_RENAMES = (
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
)
_RENAMES = (*MOE_RENAMES, (".self_attn.q_proj.", ".self_attn.query_proj."))


def read_mla(hf: HFConfig) -> MLAConfig:
    q_lora_rank = hf.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=hf.required_int("kv_lora_rank"),
        qk_nope_head_dim=hf.required_int("qk_nope_head_dim"),
        qk_rope_head_dim=hf.required_int("qk_rope_head_dim"),
        v_head_dim=hf.required_int("v_head_dim"),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def sigmoid_routed_experts(hf: HFConfig, num_layers: int) -> MoEConfig | None:
    """DeepSeek's experts (GLM-4.5 MoE's too): `n_routed_experts` of `moe_intermediate_size`,
    `n_shared_experts` of them shared (one MLP of their combined size, ungated), the sigmoid router
    over `n_group` groups, dense layers before `first_k_dense_replace` (and off the
    `moe_layer_freq` stride DeepSeek-V2 configs name)."""
    routing = expert_routing(
        {"num_experts": hf.get("n_routed_experts"), "num_experts_per_tok": hf.get("num_experts_per_tok")}, hf.source
    )
    if routing is None:
        return None
    num_experts, top_k = routing
    intermediate_size = hf.required_int("moe_intermediate_size")
    num_groups = int(hf.get("n_group") or 1)
    top_k_groups = int(hf.get("topk_group") or num_groups)
    if num_experts % num_groups or not 1 <= top_k_groups <= num_groups:
        raise ValueError(
            f"{hf.source}: n_group ({num_groups}) must divide n_routed_experts ({num_experts}) and "
            f"topk_group ({top_k_groups}) be between 1 and n_group"
        )
    if top_k > top_k_groups * (num_experts // num_groups):
        raise ValueError(f"{hf.source}: num_experts_per_tok ({top_k}) exceeds the experts of topk_group groups")
    first_sparse = int(hf.get("first_k_dense_replace") or 0)
    stride = int(hf.get("moe_layer_freq") or 1)
    sparse = tuple(i >= first_sparse and i % stride == 0 for i in range(num_layers))
    return MoEConfig(
        num_experts,
        top_k,
        intermediate_size,
        bool(hf.get("norm_topk_prob", True)),
        intermediate_size * int(hf.get("n_shared_experts") or 0),
        sparse,
        sigmoid_routing=True,
        num_groups=num_groups,
        top_k_groups=top_k_groups,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        shared_expert_gated=False,
    )


def read_config(hf: HFConfig) -> ModelConfig:
    mla = read_mla(hf)
    config = hf.decoder(moe=sigmoid_routed_experts)
    # The rotary tables span the rope dims only (transformers sets head_dim to them too).
    return replace(config, head_dim=mla.qk_rope_head_dim, num_kv_heads=config.num_heads, mla=mla)


def renaming(
    renames: tuple[tuple[str, str], ...],
) -> tuple[Callable[[Iterable[CheckpointItem]], Iterator[CheckpointItem]], Callable[[list[str]], list[str]]]:
    """A family's checkpoint_tensors and checkpoint_names for these (checkpoint's, pagoda's) parts."""

    def checkpoint_tensors(items: Iterable[CheckpointItem]) -> Iterator[CheckpointItem]:
        for file_name, name, tensor, int4_codes in items:
            for theirs, ours in renames:
                name = name.replace(theirs, ours)
            yield file_name, name, tensor, int4_codes

    def checkpoint_names(names: list[str]) -> list[str]:
        spelled = []
        for name in names:
            for theirs, ours in renames:
                name = name.replace(ours, theirs)
            spelled.append(name)
        return spelled

    return checkpoint_tensors, checkpoint_names


_tensors, _names = renaming(_RENAMES)
FAMILY = ModelFamily(read_config=read_config, checkpoint_tensors=_tensors, checkpoint_names=_names)
