"""Mamba2Mixer: the state-space layer of Granite 4.0-H (transformers'
`GraniteMoeHybridMambaLayer`), with parameters named as its checkpoints name them.

Per token: one input projection gives the gate z, the x|B|C channels (through a short causal
convolution with SiLU, pagoda.model.short_conv) and dt per head; the selective scan
(pagoda.kernels.ssd) runs with A = -exp(A_log), dt = softplus(dt + dt_bias) and the skip D; its
output times silu(z) is RMS-normalized per group and projected back. Each sequence carries its
convolution window and SSM state in its slot of the state cache (pagoda.model.linear_state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.kernels.ssd import discretize
from pagoda.model.layers import Linear
from pagoda.model.linear_attention_config import Mamba2Config
from pagoda.model.linear_state import LinearStateBatch
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.short_conv import ShortConv
from pagoda.quant.weight_formats import WeightFormat


class Mamba2Mixer(nn.Module):
    projection_scale: torch.Tensor | None  # a buffer (Falcon-H1's muP multipliers of in_proj's parts)

    def __init__(
        self,
        mamba: Mamba2Config,
        hidden_size: int,
        rms_norm_eps: float,
        layer_index: int,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
    ) -> None:
        super().__init__()
        if tp.world_size > 1:
            raise ValueError("tensor parallelism is not supported for Mamba2 layers yet")
        self.layer_index = layer_index
        self.config = mamba
        self.kernels = kernels
        self.eps = rms_norm_eps
        inner, heads = mamba.intermediate_size, mamba.num_heads
        self.in_proj = Linear(
            hidden_size, inner + mamba.conv_dim + heads, mamba.proj_bias, dtype, device, weight_format, kernels=kernels
        )
        self.conv1d = ShortConv(mamba.conv_dim, mamba.conv_kernel_size, mamba.conv_bias, dtype, device, kernels)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=dtype, device=device), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads, dtype=dtype, device=device), requires_grad=False)
        self.norm = _GroupNormWeight(inner, dtype, device) if mamba.gated_norm != "none" else None
        scale = None
        if mamba.projection_multipliers is not None:  # per channel: z, x, B, C, dt
            z, x, b, c, dt = mamba.projection_multipliers
            groups = mamba.num_groups * mamba.state_size
            sizes = ((inner, z), (inner, x), (groups, b), (groups, c), (heads, dt))
            scale = torch.cat([torch.full((size,), value) for size, value in sizes]).to(dtype=dtype, device=device)
        self.register_buffer("projection_scale", scale, persistent=False)
        self.out_proj = Linear(inner, hidden_size, mamba.proj_bias, dtype, device, weight_format, kernels=kernels)

    def forward(self, hidden: torch.Tensor, states: LinearStateBatch | None) -> torch.Tensor:
        assert states is not None, "a hybrid model's step carries its state cache"
        c = self.config
        num_tokens = hidden.shape[0]
        windows, ssm = states.conv_windows[self.layer_index], states.recurrent[self.layer_index]
        assert windows is not None and ssm is not None, "every Mamba2 layer has its state"
        if c.in_multiplier is not None:
            hidden = hidden * c.in_multiplier
        projected = self.in_proj(hidden)
        if self.projection_scale is not None:
            projected = projected * self.projection_scale
        gate, xbc, dt = torch.split(projected, [c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)
        decoding, others = states.decoding, states.chunked
        rows, slots = states.decoding_index(hidden.device)

        conv = torch.empty_like(xbc)
        if decoding:
            conv[rows], windows[slots] = self.conv1d.step(xbc[rows], windows[slots])
        for i in others:
            slot, fresh = states.slots[i], states.fresh[i]
            for span, snapshot in states.pieces(i):
                conv[span], windows[slot] = self.conv1d.prefill(xbc[span], None if fresh else windows[slot])
                if snapshot is not None:
                    windows[snapshot] = windows[slot]
                fresh = False

        groups = c.num_groups * c.state_size
        x, B, C = torch.split(conv, [c.intermediate_size, groups, groups], dim=-1)
        x = x.reshape(num_tokens, c.num_heads, c.head_dim)
        B = B.reshape(num_tokens, c.num_groups, c.state_size)
        C = C.reshape(num_tokens, c.num_groups, c.state_size)
        dt = discretize(dt, self.dt_bias, c.time_step_limit)
        A = -torch.exp(self.A_log.float())

        y = torch.empty(num_tokens, c.num_heads, c.head_dim, dtype=torch.float32, device=hidden.device)
        scan = self.kernels.ssd
        if decoding:
            y[rows], ssm[slots] = scan.step(x[rows], dt[rows], A, B[rows], C[rows], self.D, ssm[slots])
        for i in others:
            slot, fresh = states.slots[i], states.fresh[i]
            for span, snapshot in states.pieces(i):
                state = None if fresh else ssm[slot]
                y[span], ssm[slot] = scan.chunked(x[span], dt[span], A, B[span], C[span], self.D, state, c.chunk_size)
                if snapshot is not None:
                    ssm[snapshot] = ssm[slot]
                fresh = False

        # The gated RMSNorm, per group in float32: of y * silu(z), or of y then times silu(z), or none.
        y = y.reshape(num_tokens, -1)
        silu_z = F.silu(gate.float())
        if self.norm is None:
            return self.out_proj((y * silu_z).to(hidden.dtype))
        if c.gated_norm == "after_gate":
            y = y * silu_z
        grouped = y.view(num_tokens, c.num_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm.weight * grouped.view(num_tokens, -1)
        if c.gated_norm == "before_gate":
            normed = normed * silu_z
        return self.out_proj(normed.to(hidden.dtype))


class _GroupNormWeight(nn.Module):
    """The gated group norm's weight, as checkpoints name it (`norm.weight`)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)
