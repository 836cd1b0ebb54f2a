"""GatedDeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5 (transformers'
`Qwen3NextGatedDeltaNet`), with parameters named as their checkpoints name them.

Per token: one input projection gives q, k, v (through a short causal convolution with SiLU,
pagoda.model.short_conv), the output gate z, and b, a per value head; beta = sigmoid(b) and the
log decay g = -exp(A_log) * softplus(a + dt_bias) drive the gated delta rule
(pagoda.kernels.delta_rule), whose output is RMS-normalized per head, multiplied by silu(z), and
projected back. Nothing grows with the context: each sequence carries its convolution window and
recurrent state in its slot of the state cache (pagoda.model.linear_state), read and written in
place each step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.layers import Linear, RMSNorm
from pagoda.model.linear_attention_config import LinearAttentionConfig
from pagoda.model.linear_state import LinearStateBatch
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.short_conv import ShortConv
from pagoda.quant.weight_formats import WeightFormat


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        linear: LinearAttentionConfig,
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
            raise ValueError("tensor parallelism is not supported for Gated DeltaNet (linear-attention) layers yet")
        self.layer_index = layer_index
        self.config = linear
        self.kernels = kernels
        value_dim, conv_dim = linear.value_dim, linear.conv_dim
        heads = linear.num_value_heads
        # Qwen3.5's separate projections load into these fused ones, in order: (qkv, z) and (b, a).
        self.in_proj_qkvz = Linear(
            hidden_size,
            conv_dim + value_dim,
            False,
            dtype,
            device,
            weight_format,
            tp.column(hidden_size, conv_dim, value_dim),
            kernels=kernels,
        )
        self.in_proj_ba = Linear(
            hidden_size, 2 * heads, False, dtype, device, None, tp.column(hidden_size, heads, heads), kernels=kernels
        )
        self.conv1d = ShortConv(conv_dim, linear.conv_kernel_size, False, dtype, device, kernels)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=dtype, device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=dtype, device=device), requires_grad=False)
        self.norm = RMSNorm(linear.value_head_dim, rms_norm_eps, dtype, device, False, kernels)
        self.out_proj = Linear(
            value_dim,
            hidden_size,
            False,
            dtype,
            device,
            weight_format,
            tp.row(value_dim, hidden_size, "the linear attention output"),
            tp.all_reduce,
            kernels=kernels,
        )

    def _split_projections(
        self, qkvz: torch.Tensor, ba: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mixed q|k|v [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv]) in head order."""
        c = self.config
        num_tokens = qkvz.shape[0]
        if c.projection == "separate":
            heads = c.num_value_heads
            return qkvz[:, : c.conv_dim], qkvz[:, c.conv_dim :], ba[:, :heads], ba[:, heads:]
        # Qwen3-Next: per key head, its q, k, then the v and z of the value heads it serves, and b, a alike.
        per = c.num_value_heads // c.num_key_heads
        grouped = qkvz.view(num_tokens, c.num_key_heads, -1)
        q, k, v, z = torch.split(
            grouped, [c.key_head_dim, c.key_head_dim, per * c.value_head_dim, per * c.value_head_dim], dim=-1
        )
        b, a = torch.split(ba.view(num_tokens, c.num_key_heads, 2 * per), [per, per], dim=-1)
        mixed = torch.cat((q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)), dim=-1)
        return mixed, z.reshape(num_tokens, -1), b.reshape(num_tokens, -1), a.reshape(num_tokens, -1)

    def forward(self, hidden: torch.Tensor, states: LinearStateBatch | None) -> torch.Tensor:
        assert states is not None, "a hybrid model's step carries its state cache"
        c = self.config
        num_tokens = hidden.shape[0]
        windows, recurrent = states.conv_windows[self.layer_index], states.recurrent[self.layer_index]
        assert windows is not None and recurrent is not None, "every linear layer has its state"
        mixed, z, b, a = self._split_projections(self.in_proj_qkvz(hidden), self.in_proj_ba(hidden))
        decoding, others = states.decoding, states.chunked
        rows, slots = states.decoding_index(hidden.device)

        # The short convolution, carried over each sequence's window.
        conv = torch.empty_like(mixed)
        if decoding:
            conv[rows], windows[slots] = self.conv1d.step(mixed[rows], windows[slots])
        for i in others:
            slot, fresh = states.slots[i], states.fresh[i]
            for span, snapshot in states.pieces(i):
                conv[span], windows[slot] = self.conv1d.prefill(mixed[span], None if fresh else windows[slot])
                if snapshot is not None:
                    windows[snapshot] = windows[slot]
                fresh = False

        q, k, v = torch.split(conv, [c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = q.reshape(num_tokens, c.num_key_heads, c.key_head_dim)
        k = k.reshape(num_tokens, c.num_key_heads, c.key_head_dim)
        v = v.reshape(num_tokens, c.num_value_heads, c.value_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        # The gated delta rule: one step for the decoding sequences together, chunks for the others.
        core = torch.empty(num_tokens, c.num_value_heads, c.value_head_dim, dtype=torch.float32, device=hidden.device)
        rule = self.kernels.delta_rule
        if decoding:
            core[rows], recurrent[slots] = rule.step(q[rows], k[rows], v[rows], g[rows], beta[rows], recurrent[slots])
        for i in others:
            slot, fresh = states.slots[i], states.fresh[i]
            for span, snapshot in states.pieces(i):
                state = None if fresh else recurrent[slot]
                core[span], recurrent[slot] = rule.chunked(q[span], k[span], v[span], g[span], beta[span], state)
                if snapshot is not None:
                    recurrent[snapshot] = recurrent[slot]
                fresh = False

        # The gated RMSNorm: norm per head in the model's dtype, then times silu(z) in float32.
        normed = self.norm(core.to(hidden.dtype).reshape(-1, c.value_head_dim))
        assert isinstance(normed, torch.Tensor)
        gated = (normed * F.silu(z.reshape(-1, c.value_head_dim).float())).to(hidden.dtype)
        return self.out_proj(gated.reshape(num_tokens, c.value_dim))
