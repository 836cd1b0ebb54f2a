"""The shared decoder every family runs on (pagoda.model.families): embedding, decoder layers of
attention and MLP (or sparse MoE) with RMSNorms, final norm and LM head.

What differs between families is a parameter of the shared blocks, read from ModelConfig:
q/k/v (and o) bias, per-head q/k RMSNorm, per-layer sliding windows, rope scaling and per-layer
rope bases, tied embeddings, Gemma-style norms ((1 + w) RMSNorms, a norm after attention and two
around the MLP), an embedding scale, the gate's activation, the attention scale, soft-capped
attention scores and logits, partial rotary, attention sinks (one learned logit per head, a parameter of the
attention backend), and which layers have a `SparseMoE` block (pagoda.model.moe) in place of
the dense MLP. q/k/v and gate/up are fused into single matmuls; the loader splits checkpoints'
tensors into them (or takes already fused ones as they are). A family whose layers differ from
these blocks gives its own classes in its module and reuses the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from pagoda.kernels import Kernels
from pagoda.kernels.attention import AttentionBackend, AttentionLayerSpec
from pagoda.model.classifier import ClassifierHead
from pagoda.model.gated_delta_net import GatedDeltaNet
from pagoda.model.layers import Linear, RMSNorm, RotaryEmbedding
from pagoda.model.linear_attention_config import LinearAttentionConfig, Mamba2Config
from pagoda.model.linear_state import LinearStateBatch
from pagoda.model.mamba2 import Mamba2Mixer
from pagoda.model.mla import LatentAttention
from pagoda.model.mlp import MLP
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe import SparseMoE
from pagoda.model.parallel import LinearShard, Slice, TensorParallelGroup, VocabParallelEmbedding
from pagoda.model.pipeline import OtherStageLayer, PipelineStage
from pagoda.model.vision.encoder import VisionEncoder
from pagoda.quant.weight_formats import WeightFormat


@dataclass
class InputEmbeds:
    """Rows of a step's input whose embeddings are given instead of looked up: an image's
    features in place of its placeholder tokens (pagoda.model.vision)."""

    rows: torch.Tensor  # [n] long, rows of the flattened batch
    values: torch.Tensor  # [n, hidden]
    # Qwen3-VL's DeepStack: rows added to the same positions' hidden states after layer i.
    layer_additions: tuple[torch.Tensor, ...] = ()


@dataclass
class ForwardContext:
    """What every layer needs for one step besides its input: where the KV lives and how to
    attend over it. Passed down explicitly (no global context)."""

    backend: AttentionBackend
    metadata: list[object]  # per layer: the backend's metadata of the layer's KV cache group
    # per layer (key_cache, value_cache), a latent attention layer's (latents, rope keys); None: other stages
    kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None]
    # A hybrid model's linear-attention layers: the step's slots of the state cache.
    linear_states: LinearStateBatch | None = None


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them without tensor parallelism)."""

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
        self.layer_index = layer_index
        heads = tp.attention_heads(config.num_heads, config.num_kv_heads, config.head_dim)
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        full_q = config.num_heads * config.head_dim
        # Qwen3-Next's output gate: q_proj gives each head its query, then its gate.
        self.q_width = 2 if config.attention_output_gate else 1
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_width * full_q + 2 * config.num_kv_heads * config.head_dim,
            config.qkv_bias,
            dtype,
            device,
            weight_format,
            tp.qkv(config.hidden_size, heads, config.num_heads, config.num_kv_heads, self.q_width),
            kernels=kernels,
        )
        self.o_proj = Linear(
            full_q,
            config.hidden_size,
            config.o_bias,
            dtype,
            device,
            weight_format,
            tp.row(full_q, config.hidden_size, "the attention output"),
            tp.all_reduce,
            kernels=kernels,
        )
        norm_args = (self.head_dim, config.rms_norm_eps, dtype, device, config.unit_offset_norms, kernels)
        self.q_norm = RMSNorm(*norm_args) if config.qk_norm else None
        self.k_norm = RMSNorm(*norm_args) if config.qk_norm else None
        scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.rotates = not config.no_rope  # Granite 4.0-H's attention has no positional rotation
        self.sinks = None
        if config.attention_sinks:  # this rank's heads' sinks; the loader takes them via `shard`
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype, device=device), requires_grad=False)
            first_head = heads.q_rows.start // config.head_dim
            self.shard = LinearShard((config.num_heads,), (Slice(first_head, self.num_heads),), 1, Slice(0, 1))
        self.spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=scale,
            sliding_window=config.layer_sliding_windows[layer_index],
            logit_softcap=config.attn_logit_softcap,
            sinks=self.sinks,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        context: ForwardContext,
    ) -> torch.Tensor:
        """rope: this step's (cos, sin_rolled) rows from `rotary.tables`, gathered once per step."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_end = self.q_width * self.q_size
        qk_size = q_end + self.kv_size
        v = qkv[:, qk_size:].reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        gate = None
        if self.q_width == 2:  # each head's query, then its gate
            gated = qkv[:, :q_end].view(num_tokens, self.num_heads, 2, self.head_dim)
            q, gate = gated[:, :, 0].contiguous(), gated[:, :, 1].reshape(num_tokens, self.q_size)
        else:
            q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)
        if (self.q_norm is None or self.k_norm is None) and gate is None:  # both or neither (config.qk_norm)
            # q and k heads side by side in the fused output: one rotation for both
            qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.rotates:
                qk = rotary(qk, *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:  # Qwen3, Gemma 3: per-head norms (separate weights) come before the rotation
            k = qkv[:, q_end:qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotates:
                q, k = rotary(q, *rope), rotary(k, *rope)
        caches = context.kv_caches[self.layer_index]
        assert caches is not None, "a stage allocates the caches of every layer it runs"
        key_cache, value_cache = caches
        out = context.backend.forward(q, k, v, key_cache, value_cache, context.metadata[self.layer_index], self.spec)
        out = out.reshape(num_tokens, self.q_size)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))


class DecoderLayer(nn.Module):
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
        norm_args = (config.hidden_size, config.rms_norm_eps, dtype, device, config.unit_offset_norms, kernels)
        self.input_layernorm = RMSNorm(*norm_args)
        # A hybrid model's recurrent layers mix tokens with Gated DeltaNet or Mamba2 instead of attention.
        recurrent = config.linear_attention
        self.linear_attn: GatedDeltaNet | None = None
        self.mamba: Mamba2Mixer | None = None
        mixer_args = (config.hidden_size, config.rms_norm_eps, layer_index, dtype, device, weight_format, tp, kernels)
        if isinstance(recurrent, LinearAttentionConfig) and recurrent.layers[layer_index]:
            self.linear_attn = GatedDeltaNet(recurrent, *mixer_args)
        elif isinstance(recurrent, Mamba2Config) and recurrent.layers[layer_index]:
            self.mamba = Mamba2Mixer(recurrent, *mixer_args)
        else:
            attention = Attention if config.mla is None else LatentAttention  # latent: pagoda.model.mla
            self.self_attn = attention(config, layer_index, dtype, device, weight_format, tp, kernels)
        self.residual_multiplier = config.residual_multiplier
        # Llama: the norm before the MLP. Gemma: the norm of the attention output, with two more
        # around the MLP.
        self.post_attention_layernorm = RMSNorm(*norm_args)
        self.gemma_norms = config.gemma_norms
        if config.gemma_norms:
            self.pre_feedforward_layernorm = RMSNorm(*norm_args)
            self.post_feedforward_layernorm = RMSNorm(*norm_args)
        self.mlp: SparseMoE | MLP
        if config.moe is not None and config.moe.sparse_layers[layer_index]:
            self.mlp = SparseMoE(config, dtype, device, weight_format, tp, kernels)
        else:
            self.mlp = MLP(
                config.hidden_size,
                config.intermediate_size,
                config.mlp_bias,
                config.hidden_activation,
                dtype,
                device,
                weight_format,
                tp,
                kernels,
            )

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        context: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream is carried apart from each block's output, and the norms fold the
        adds in (RMSNorm with a residual): hidden is the previous layer's output still to be added
        to `residual`, or, with residual None, the stream itself. Returns this layer's (output,
        residual) the same way; the stream is never written in place, the outputs are."""
        hidden, residual = self.input_layernorm.open_block(hidden, residual)
        if self.linear_attn is not None:
            hidden = self.linear_attn(hidden, context.linear_states)
        elif self.mamba is not None:
            hidden = self.mamba(hidden, context.linear_states)
        else:
            hidden = self.self_attn(hidden, rope, rotary, context)
        scale = self.residual_multiplier
        if scale is not None:  # Granite: each block's output scaled before the residual add
            hidden = hidden * scale
        if self.gemma_norms:
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual, self.post_attention_layernorm)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out = self.mlp(hidden)
        return (out if scale is None else out * scale), residual


class DecoderStack(nn.Module):
    """The checkpoints' `model.` prefix: embedding, decoder layers and final norm, the embedding
    and norm None where another pipeline stage holds them (filled in by DecoderModel)."""

    embed_tokens: VocabParallelEmbedding | None
    layers: nn.ModuleList  # DecoderLayer, or OtherStageLayer for another stage's
    norm: RMSNorm | None


class DecoderModel(nn.Module):
    """Decoder stack + LM head. Parameter names match the checkpoints' (after q/k/v and
    gate/up fusion), e.g. `model.layers.0.self_attn.qkv_proj.weight`.

    `weight_format` is used by the decoder layers' projections; embeddings and the LM head stay
    in full precision (as vLLM and llama.cpp's default mixes keep them).

    `tp`: this rank's tensor-parallel group (pagoda.model.parallel); layers hold the rank's
    shards and `num_kv_heads` is the rank's count (what its KV cache holds).

    `stage`: this pipeline stage (pagoda.model.pipeline): only its decoder layers are built, the
    embedding on the first stage, the final norm and LM head on the last.

    `kernels`: the ops' implementations for the device (pagoda.kernels; None: PyTorch's), which
    every layer calls."""

    embedding_scale: torch.Tensor | None  # a buffer
    vision: VisionEncoder | None

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None = None,
        tp: TensorParallelGroup | None = None,
        stage: PipelineStage | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        kernels = kernels or Kernels(device)
        self.kernels = kernels
        self.config = config
        self.tp = tp or TensorParallelGroup()
        self.stage = stage or PipelineStage(0, 1, 0, config.num_layers)
        self.model = DecoderStack()
        # A vision-language family's image encoder (its model class sets it); None: text only.
        self.vision = None
        # The last stage's head is the embedding matrix when they are tied.
        holds_embedding = self.stage.is_first or (self.stage.is_last and config.tie_word_embeddings)
        self.model.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device, self.tp, kernels)
            if holds_embedding
            else None
        )
        self.model.layers = nn.ModuleList(
            self.build_layer(config, i, dtype, device, weight_format, self.tp, kernels)
            if self.stage.holds_layer(i)
            else OtherStageLayer()
            for i in range(config.num_layers)
        )
        attention = self.first_attention
        self.num_kv_heads = attention.num_kv_heads
        self.model.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, config.unit_offset_norms, kernels)
            if self.stage.is_last
            else None
        )
        self.lm_head = (
            None
            if config.tie_word_embeddings or not self.stage.is_last
            else Linear(
                config.hidden_size,
                config.vocab_size,
                False,
                dtype,
                device,
                weight_format=weight_format if weight_format is not None and weight_format.holds_head else None,
                shard=self.tp.vocab(config.vocab_size, config.hidden_size),
                kernels=kernels,
            )
        )
        # A classifier's head (scoring, pagoda/worker/pooling.py), on the last stage.
        self.score = (
            ClassifierHead(config.classifier, config.hidden_size, dtype, device)
            if config.classifier is not None and self.stage.is_last
            else None
        )
        # In the model dtype, as transformers multiplies by it.
        self.register_buffer(
            "embedding_scale",
            None
            if config.embedding_scale is None
            else torch.tensor(config.embedding_scale, dtype=dtype, device=device),
            persistent=False,
        )
        # One table per distinct (theta, scaling) (Gemma 3: local and global layers); each layer
        # reads its own.
        layer_ropes = [config.layer_rope(i) for i in range(config.num_layers)]
        distinct = []
        for rope in layer_ropes:
            if rope not in distinct:
                distinct.append(rope)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(
                config.rotary_dim,
                config.max_position_embeddings,
                theta,
                scaling,
                dtype,
                device,
                config.long_rope_boundary,
                kernels,
                config.mrope_section,
                config.mrope_interleaved,
            )
            for theta, scaling in distinct
        )
        self.layer_rotary = [distinct.index(rope) for rope in layer_ropes]

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
        """One decoder layer: the shared one; a family whose layers differ overrides this."""
        return DecoderLayer(config, layer_index, dtype, device, weight_format, tp, kernels)

    @property
    def first_attention(self) -> Attention | LatentAttention:
        """This stage's first attention layer (a hybrid model's first layers may be recurrent ones)."""
        for index in self.stage.layers:
            attention = getattr(self.model.layers[index], "self_attn", None)
            if isinstance(attention, (Attention, LatentAttention)):
                return attention
        raise ValueError("a pipeline stage without an attention layer is not supported")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        hidden: torch.Tensor | None = None,
        embeds: InputEmbeds | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token. positions: each token's
        position, plus config.long_rope_boundary for sequences on LongRoPE's long factors (its
        row of the rotary tables, see RotaryEmbedding). A later pipeline stage starts from the
        previous stage's `hidden`; a stage before the last returns its layers' output without
        the norm. `embeds`: rows whose input is given (image features), written over the
        looked-up (and scaled) embeddings, as transformers' vision-language models scatter them."""
        if self.stage.is_first:
            assert self.model.embed_tokens is not None, "the first stage holds the embedding"
            hidden = self.model.embed_tokens(input_ids)
            if self.embedding_scale is not None:
                hidden = hidden * self.embedding_scale
            if embeds is not None:
                hidden = hidden.index_put((embeds.rows,), embeds.values.to(hidden.dtype))
        elif hidden is None:
            raise ValueError("a later pipeline stage starts from the previous stage's hidden states")
        rotaries = cast("Iterable[RotaryEmbedding]", self.rotaries)
        ropes = [rotary.tables(positions) for rotary in rotaries]  # once per step, shared by the layers
        residual = None
        for index in self.stage.layers:
            rotary = self.layer_rotary[index]
            hidden, residual = self.model.layers[index](hidden, residual, ropes[rotary], self.rotaries[rotary], context)
            if embeds is not None and index < len(embeds.layer_additions):  # the stream is residual + hidden
                hidden = hidden.index_add(0, embeds.rows, embeds.layer_additions[index].to(hidden.dtype))
        if not self.stage.is_last:
            return hidden if residual is None else residual + hidden
        assert self.model.norm is not None, "the last stage holds the final norm"
        return self.model.norm(hidden) if residual is None else self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding matrix is the head
            assert self.model.embed_tokens is not None, "the last stage holds a tied head's embedding"
            logits = self.model.embed_tokens.as_head(hidden)
        else:
            logits = self.lm_head(hidden)  # through its weight format (pre-packed on CPU)
        logits = self.tp.gather_logits(logits, self.config.vocab_size)
        if self.config.logits_divisor is not None:  # Granite's logits_scaling
            logits = logits / self.config.logits_divisor
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
