"""Building blocks of the decoder: linear, RMSNorm, rotary embedding.

Computations follow transformers' op order so float32 outputs match it to rounding.
Parameters are allocated uninitialised: the loader fills every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.mrope import mrope_components
from pagoda.model.parallel import LinearShard
from pagoda.model.rope import rope_attention_factor, rope_inv_freq
from pagoda.quant.weight_formats import FullWeight, WeightFormat


class Linear(nn.Module):
    """y = x @ W^T + b, with W stored by a weight format (pagoda.quant) and multiplied by the
    kernels' linear op (pagoda.kernels.linear), which picks the format's product for the device.

    The shape other features build on (DESIGN.md, "One linear layer"):
    - `weight_format` owns storage and loading: loaders write full-precision rows into the
      staging `weight` [out_features, in_features] (fused parts by row offset), then call
      `finalize(name)`, which lets the format quantize and pack; `forward` calls
      `kernels.linear`. The model code never branches on the format.
    - Tensor parallelism: `shard` (pagoda.model.parallel.LinearShard, column or row parallel)
      makes in/out features the rank's slice; loaders narrow checkpoint tensors with
      `shard.take`; a row-parallel layer all-reduces its output in `forward` after `apply`,
      then adds the (unsplit) bias once.
    - LoRA (to come) wraps a Linear and adds its batched delta to `forward`'s output; it needs
      only `in_features`/`out_features`, never the base weight's storage.
    """

    # The staging weight the format registers (`create_weights`); most formats replace it at `finalize`.
    weight: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None = None,
        shard: LinearShard | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        """in/out features are the whole layer's; with a shard the layer holds the rank's slice
        and `reduce` (the group's all-reduce) sums a row-parallel layer's partial outputs.
        kernels: the model's (None: PyTorch's for `device`)."""
        super().__init__()
        self.kernels = kernels or Kernels(device)
        # --- tensor parallelism (pagoda.model.parallel) ---
        self.shard = shard or LinearShard.whole(in_features, out_features)
        self.reduce = reduce if self.shard.reduce else None
        in_features, out_features = self.shard.local_in, self.shard.local_out
        # --- end tensor parallelism ---
        self.in_features = in_features
        self.out_features = out_features
        self.weight_format = (weight_format or FullWeight()).for_layer(in_features)
        self.weight_format.create_weights(self, in_features, out_features, dtype, device)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def finalize(self, name: str) -> None:
        """After loading: let the weight format convert the staged weight (quantize, pack)."""
        self.weight_format.finalize(self, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return self.kernels.linear(self, x, self.bias)
        out = self.reduce(self.kernels.linear(self, x, None))  # row parallel: sum the partial outputs
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """unit_offset: Gemma's form, which scales by (1 + weight) and casts after the product.

    Called with a residual, it also adds: the decoder keeps its residual stream apart from each
    block's output and this norm folds the add in (one pass instead of two); the kernels' norm
    (pagoda.kernels.norm) may write the sum into the block output's buffer, which the caller
    hands over."""

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        unit_offset: bool = False,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        self.kernels = kernels or Kernels(device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, pre_norm: RMSNorm | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With it: (norm(s), s) for the new residual stream
        s = residual + x, or residual + pre_norm(x) (Gemma's norm of a block's output before the
        add); x is consumed (an implementation may overwrite it with s)."""
        norm = self.kernels.norm
        if residual is None:
            return norm.rms_norm(x, self.weight, self.eps, self.unit_offset)
        # pre_norm's own forward is not called: its time is this call's (forward hooks, profiles)
        return norm.add_rms_norm(
            x, residual, self.weight, self.eps, self.unit_offset, None if pre_norm is None else pre_norm.weight
        )

    def open_block(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder block's first norm: (norm of the stream, the stream). `hidden` is the previous
        block's output still to be added to `residual`, or with residual None the stream itself."""
        if residual is None:
            return self(hidden), hidden
        return self(hidden, residual)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position.

    The model gathers a step's rows once (`tables`) and every layer rotates its q and k heads
    together in one call. rotate_half(x) * sin is computed as roll(x) * sin_rolled, where
    sin_rolled is sin with its first half negated: the same products with the sign moved
    to the table, so results are bit-identical to transformers' form with one op fewer.

    long_rope_boundary: the model runs LongRoPE (pagoda.model.rope); the table then holds the
    rows of the short factors for positions below it, then those of the long factors for every
    position, and a token on the long factors reads row boundary + position. A rotary of another
    rope type in such a model repeats its rows the same way.

    The rotation itself is the kernels' rotary (pagoda.kernels.rotary)."""

    cos: torch.Tensor  # buffers [positions, head_dim]
    sin_rolled: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
        long_rope_boundary: int | None = None,
        kernels: Kernels | None = None,
        mrope_section: tuple[int, ...] | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        self.kernels = kernels or Kernels(device)
        # M-RoPE (Qwen2.5-VL): each frequency rotates by one of three positions (temporal,
        # height, width), in sections of the frequencies; `tables` then takes [3, T] positions.
        self.mrope_columns = None
        if mrope_section is not None:
            components = torch.tensor(mrope_components(mrope_section, mrope_interleaved))
            self.mrope_columns = torch.cat((components, components)).to(device)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        if long_rope_boundary is not None:
            long_freqs = torch.outer(
                torch.arange(max_positions, dtype=torch.float32),
                rope_inv_freq(head_dim, theta, scaling, long_factors=True),
            )
            freqs = torch.cat((freqs[:long_rope_boundary], long_freqs))
        emb = torch.cat((freqs, freqs), dim=-1)
        attention_factor = rope_attention_factor(scaling)
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        half = head_dim // 2
        self.register_buffer("cos", cos.to(dtype=dtype, device=device), persistent=False)
        self.register_buffer(
            "sin_rolled",
            torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype=dtype, device=device),
            persistent=False,
        )

    def tables(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_rolled rows [T] (positions, shifted on LongRoPE's long factors), shaped
        [T, 1, D] to broadcast over heads."""
        if rows.dim() == 2:  # M-RoPE: [3, T] positions, each column from its component's row
            assert self.mrope_columns is not None, "3-D positions need an M-RoPE model"
            columns = self.mrope_columns.expand(rows.shape[1], -1).unsqueeze(0)
            cos = self.cos[rows].gather(0, columns).squeeze(0)
            sin_rolled = self.sin_rolled[rows].gather(0, columns).squeeze(0)
            return cos.unsqueeze(1), sin_rolled.unsqueeze(1)
        return self.cos[rows].unsqueeze(1), self.sin_rolled[rows].unsqueeze(1)

    def forward(self, heads: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor) -> torch.Tensor:
        """heads [T, N, D] (q heads, k heads, or both side by side) with this step's tables; the
        heads are consumed (an implementation may rotate them in place). Tables narrower than
        the heads (partial rotary): the first features rotate, the others pass through."""
        rotary_dim = cos.shape[-1]
        if heads.shape[-1] == rotary_dim:
            return self.kernels.rotary(heads, cos, sin_rolled)
        rotated = self.kernels.rotary(heads[..., :rotary_dim].contiguous(), cos, sin_rolled)
        return torch.cat((rotated, heads[..., rotary_dim:]), dim=-1)
