"""The attention backend interface: a torch reference on CPU, Triton kernels on GPU.

The model runner describes one step's flattened batch as a `BatchLayout`. The backend turns
it once per step into whatever metadata its kernels want (shared by every layer), and each
layer calls `forward`, which writes the new K/V into the paged cache and attends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pagoda.kernels.attention.latent import LatentProjection


@dataclass
class BatchLayout:
    """One step's requests, flattened: request i owns query tokens
    [query_start_loc[i], query_start_loc[i+1]) at positions [context_lens[i], seq_lens[i])."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    context_lens: torch.Tensor  # [num_reqs] int64: tokens already in the cache
    seq_lens: torch.Tensor  # [num_reqs] int64: context + new tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    block_size: int
    # Host copies, so backends can plan without device syncs.
    query_lens_host: list[int]
    context_lens_host: list[int]
    # Per request, position ranges whose tokens attend to each other both ways (Gemma 3's images),
    # on top of causal (and windowed) visibility; None: causal only. Only the torch backend
    # computes them.
    bidirectional: list[list[tuple[int, int]]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_host)


@dataclass
class AttentionLayerSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None  # keys within the last `w` positions (self included), or None
    logit_softcap: float | None = None  # scores (after `scale`) become cap * tanh(scores / cap)
    # [num_heads] float32: a logit per query head that joins each softmax's denominator and
    # attends to nothing (attention sinks, as gpt-oss learns them), or None.
    sinks: torch.Tensor | None = None
    # Multi-head latent attention (pagoda.model.mla): the layer calls `forward_latent`, its caches
    # hold latents and rope keys (one cached "head" for all `num_heads`).
    latent: bool = False


class AttentionBackend(ABC):
    name: str
    supports_latent = False  # `forward_latent`: multi-head latent attention over cached latents

    def check_layers(self, specs: list[AttentionLayerSpec], model_name: str) -> None:
        """At startup: raise ValueError naming the model if a layer needs what this backend
        cannot compute."""
        if not self.supports_latent and any(spec.latent for spec in specs):
            raise ValueError(
                f"{model_name}: multi-head latent attention runs on the torch attention backend "
                f"(--attention-backend torch), not {self.name}"
            )

    def forward_latent(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        rope_key: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        metadata: object,
        spec: AttentionLayerSpec,
        projection: LatentProjection,
    ) -> torch.Tensor:
        """Multi-head latent attention (pagoda.kernels.attention.latent): q_nope [T, H, nope] and
        q_rope [T, H, rope] (rotated), the new tokens' latents [T, C] and rope keys [T, rope]
        written at the layout's slots of caches [num_blocks, block_size, 1, C | rope]. Returns
        [T, H, v]."""
        raise NotImplementedError(f"the {self.name} attention backend has no latent attention")

    @abstractmethod
    def prepare(self, layout: BatchLayout, sliding_windows: set[int | None]) -> object:
        """Per-step metadata shared by all layers (index tensors, masks, ...)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: object,
        spec: AttentionLayerSpec,
    ) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D], caches [num_blocks, block_size, KVH, D].
        Writes key/value at the layout's slots, returns the attention output [T, H, D]."""
