"""MLAConfig: the shape of multi-head latent attention (DeepSeek-V2/V3, Kimi K2), read by the
families that have it (pagoda.model.families.deepseek_v3) into ModelConfig.mla.

Each token's keys and values are one compressed latent of `kv_lora_rank` values (normalized)
plus one rope key of `qk_rope_head_dim` values shared by every head: that pair is what the paged
KV cache holds per token and layer (pagoda.model.mla), instead of K and V per head.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: one query projection; else down to this rank, normed, and up
    kv_lora_rank: int  # the latent each token caches
    qk_nope_head_dim: int  # per head: query/key dims without rope (keys expanded from the latent)
    qk_rope_head_dim: int  # per head: query dims with rope; the key's are one vector for all heads
    v_head_dim: int  # per head: values expanded from the latent
    # The checkpoint's rope dims are interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's layout):
    # they are de-interleaved before the rotate-half rotation, as transformers computes them.
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dims(self) -> tuple[int, int]:
        """The two vectors one token caches per layer: (latent, rope key)."""
        return self.kv_lora_rank, self.qk_rope_head_dim
