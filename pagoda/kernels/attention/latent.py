"""Multi-head latent attention (MLA) over a paged cache of latents, in PyTorch: the reference
(and, on CPU, the implementation) that the torch backend's `forward_latent` runs.

Each token caches, per layer, its latent c (`kv_lora_rank` values) and its rope key r
(`qk_rope_head_dim` values), shared by every head (pagoda.model.mla). Head h's key is
[W_UK[h] c, r] and its value W_UV[h] c, where W_UK and W_UV are the rows of `kv_b_proj`
(`LatentProjection`). Two ways to attend, equal up to rounding:

- expanded (prefill chunks): the context's latents go through kv_b_proj into per-head keys and
  values, then ordinary attention; cheap when many queries share the expansion;
- absorbed (decode): W_UK is folded into the query (q_nope W_UK[h] lives in latent space) and
  W_UV into the output, so scores are q_latent . c + q_rope . r against the cached latents as
  they are, one key "head" for all query heads (two batched matmuls), and nothing per context
  token is expanded: the cost per step grows with the context by (kv_lora_rank + rope) per
  token and head instead of kv_lora_rank x (nope + v) per token and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LatentProjection:
    """kv_b_proj's weight [H * (nope + v), kv_lora_rank] (head h's nope rows, then its v rows),
    read per call so that weight updates in place are seen."""

    weight: torch.Tensor
    num_heads: int
    nope_dim: int
    v_dim: int

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, C], W_UV [H, v, C]), views of the weight."""
        heads = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return heads[:, : self.nope_dim], heads[:, self.nope_dim :]

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latents [L, C] -> (keys without rope [L, H, nope], values [L, H, v])."""
        kv = F.linear(latents, self.weight).view(latents.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        return kv[..., : self.nope_dim], kv[..., self.nope_dim :]


def expanded_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    projection: LatentProjection,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One request's queries q_nope [q, H, nope], q_rope [q, H, rope] over its context's latents
    [L, C] and rope keys [L, rope], K/V expanded through kv_b_proj; mask [q, L] bool, or None for
    causal attention ending at the last key. Returns [q, H, v]."""
    k_nope, values = projection.expand(latents)
    keys = torch.cat([k_nope, rope_keys.unsqueeze(1).expand(-1, projection.num_heads, -1)], dim=-1)
    query = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    out = F.scaled_dot_product_attention(
        query,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and query.shape[2] > 1,
        scale=scale,
    )
    return out.squeeze(0).transpose(0, 1)


def absorb_query(q_nope: torch.Tensor, projection: LatentProjection) -> torch.Tensor:
    """q_nope [B, H, nope] -> q_nope W_UK [B, H, C]: the query's scores against latents."""
    key_up, _ = projection.per_head()
    return torch.bmm(q_nope.transpose(0, 1), key_up.to(q_nope.dtype)).transpose(0, 1)


def absorbed_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    projection: LatentProjection,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One query per request: q_nope [B, H, nope], q_rope [B, H, rope] over each request's latents
    [B, L, C] and rope keys [B, L, rope] (padded to L), attended in latent space; mask [B, L]
    bool (None: every key). Returns [B, H, v]."""
    q_latent = absorb_query(q_nope, projection)
    scores = torch.baddbmm(torch.bmm(q_rope, rope_keys.transpose(1, 2)), q_latent, latents.transpose(1, 2))  # [B, H, L]
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latents.dtype)
    out_latent = torch.bmm(probs, latents)  # [B, H, C]
    _, value_up = projection.per_head()
    return torch.bmm(out_latent.transpose(0, 1), value_up.transpose(1, 2).to(out_latent.dtype)).transpose(0, 1)


def expanded_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    projection: LatentProjection,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The same step as `absorbed_attention` with every context latent expanded through kv_b_proj
    (what a decode costs without absorption): the reference the absorbed form is tested and
    benchmarked against."""
    batch, length, _ = latents.shape
    k_nope, values = projection.expand(latents.reshape(batch * length, -1))
    heads = projection.num_heads
    keys = torch.cat(
        [k_nope.view(batch, length, heads, -1), rope_keys.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1
    ).transpose(1, 2)  # [B, H, L, D]
    query = torch.cat([q_nope, q_rope], dim=-1).unsqueeze(2)  # [B, H, 1, D]
    out = F.scaled_dot_product_attention(
        query,
        keys,
        values.view(batch, length, heads, -1).transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None, None, :],
        scale=scale,
    )
    return out.squeeze(2)
