"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention layer of a decoder
whose config has `mla` (pagoda.model.mla_config.MLAConfig), in place of pagoda.model.decoder's
Attention.

Queries: hidden -> q_proj (or q_a_proj -> RMSNorm -> q_b_proj with `q_lora_rank`) ->
[H, nope + rope]. Keys and values: hidden -> kv_a_proj_with_mqa -> a latent of kv_lora_rank
(RMSNorm'd: kv_a_layernorm) and one rope key for all heads; the latent and the rotated rope key
are all the paged cache holds per token (ModelConfig.kv_cache_dims), and kv_b_proj's rows turn
latents into each head's keys and values (`LatentProjection`). The attention backend attends
prefill chunks with K/V expanded from the latents and decodes with the projections absorbed
(pagoda.kernels.attention.latent). kv_b_proj stays in full precision whatever the weight format
(its rows are the absorbed projections); the other projections take the model's format.
Tensor parallelism splits the heads; every rank computes and caches the whole latent.

The checkpoint's q_proj is named `query_proj` here (the loader fuses `q_proj` into qkv_proj for
every other attention); the family renames it (pagoda.model.families.deepseek_v3).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from pagoda.kernels import Kernels
from pagoda.kernels.attention import AttentionBackend, AttentionLayerSpec
from pagoda.kernels.attention.latent import LatentProjection
from pagoda.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagoda.model.model_config import ModelConfig
from pagoda.model.parallel import LinearShard, TensorParallelGroup
from pagoda.model.rope import yarn_attention_mscale
from pagoda.quant.weight_formats import WeightFormat


class ForwardContext(Protocol):
    """pagoda.model.decoder.ForwardContext as this layer reads it (the decoder imports this module)."""

    backend: AttentionBackend
    metadata: list[object]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None]


class LatentUpProjection(nn.Module):
    """kv_b_proj: its weight [H * (nope + v), kv_lora_rank] as loaded, the rank's heads' rows
    with tensor parallelism (`shard`, which the loader takes them by); not a Linear: the absorbed
    decode reads its rows per head, so no weight format packs it."""

    def __init__(self, shard: LinearShard, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.shard = shard
        self.weight = nn.Parameter(
            torch.empty(shard.local_out, shard.local_in, dtype=dtype, device=device), requires_grad=False
        )


class LatentAttention(nn.Module):
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
        mla = config.mla
        assert mla is not None, "built for a config with latent attention"
        self.layer_index = layer_index
        self.mla = mla
        # Tensor parallelism splits the heads (q, kv_b_proj's rows, o_proj's inputs); every rank
        # computes and caches the whole latent.
        self.num_heads = tp.split(config.num_heads, "num_attention_heads").size
        self.num_kv_heads = 1  # one latent and rope key per token, shared by every head
        hidden = config.hidden_size
        heads_qk = config.num_heads * mla.qk_head_dim

        def linear(in_features: int, out_features: int, bias: bool = False, shard: LinearShard | None = None) -> Linear:
            reduce = tp.all_reduce if shard is not None and shard.reduce else None
            return Linear(in_features, out_features, bias, dtype, device, weight_format, shard, reduce, kernels)

        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, config.rms_norm_eps, dtype, device, kernels=kernels)

        self.query_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.query_proj = linear(hidden, heads_qk, shard=tp.column(hidden, heads_qk, what="q_proj"))
        else:
            self.q_a_proj = linear(hidden, mla.q_lora_rank, config.qkv_bias)
            self.q_a_layernorm = norm(mla.q_lora_rank)
            self.q_b_proj = linear(
                mla.q_lora_rank, heads_qk, shard=tp.column(mla.q_lora_rank, heads_qk, what="q_b_proj")
            )
        self.kv_a_proj_with_mqa = linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, config.qkv_bias)
        self.kv_a_layernorm = norm(mla.kv_lora_rank)
        kv_up = config.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = LatentUpProjection(tp.column(mla.kv_lora_rank, kv_up, what="kv_b_proj"), dtype, device)
        heads_v = config.num_heads * mla.v_head_dim
        self.o_proj = linear(heads_v, hidden, config.o_bias, shard=tp.row(heads_v, hidden, "the attention output"))
        # YaRN scales the softmax by its mscale twice (transformers' yarn_apply_mscale).
        scale = mla.qk_head_dim**-0.5 * yarn_attention_mscale(config.rope_scaling) ** 2
        self.spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=1,
            head_dim=mla.qk_head_dim,
            scale=scale,
            sliding_window=config.layer_sliding_windows[layer_index],
            latent=True,
        )

    def projection(self) -> LatentProjection:
        return LatentProjection(self.kv_b_proj.weight, self.num_heads, self.mla.qk_nope_head_dim, self.mla.v_head_dim)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        context: ForwardContext,
    ) -> torch.Tensor:
        mla = self.mla
        num_tokens = hidden.shape[0]
        if self.query_proj is not None:
            q = self.query_proj(hidden)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        latent = self.kv_a_layernorm(compressed[:, : mla.kv_lora_rank].contiguous())
        k_rope = compressed[:, None, mla.kv_lora_rank :]
        # The query's rope heads and the key's one side by side: one rotation for both.
        rope_heads = torch.cat([q_rope, k_rope], dim=1)
        if mla.rope_interleave:
            rope_heads = torch.cat([rope_heads[..., 0::2], rope_heads[..., 1::2]], dim=-1)
        rope_heads = rotary(rope_heads.contiguous(), *rope)
        q_rope, k_rope = rope_heads[:, : self.num_heads], rope_heads[:, self.num_heads]
        caches = context.kv_caches[self.layer_index]
        assert caches is not None, "a stage allocates the caches of every layer it runs"
        latent_cache, rope_cache = caches
        out = context.backend.forward_latent(
            q_nope,
            q_rope,
            latent,
            k_rope,
            latent_cache,
            rope_cache,
            context.metadata[self.layer_index],
            self.spec,
            self.projection(),
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim))
