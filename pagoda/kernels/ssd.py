"""Mamba2's selective state-space scan (SSD), per device: the chunked form for a prompt's tokens
and the single-step update for decoding.

One head h's state S [P, N] evolves per token t with dt_t = softplus(dt_raw_t + dt_bias)
(clamped to the layer's limits) as
    S <- exp(dt_t * A_h) * S + dt_t * x_t B_t^T;   y_t = S C_t + D_h * x_t
where x_t [P] is the head's input and B_t, C_t [N] those of its group. The chunked form is
transformers' `mamba2_chunk_scan` (the SSD's diagonal and off-diagonal blocks over chunks of
`chunk_size` tokens); `naive_ssd` is the per-token loop every implementation is tested against.
Everything runs in float32; the state is kept in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """dt [.., H] before its bias -> softplus(dt + bias) within the limits, float32."""
    return torch.clamp(F.softplus(dt.float() + dt_bias.float()), min=limit[0], max=limit[1])


def _expand_groups(m: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[.., G, N] -> [.., H, N], each group serving H / G consecutive heads."""
    return m.float().repeat_interleave(num_heads // m.shape[-2], dim=-2)


def naive_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, token by token: x [T, H, P], dt [T, H] (discretized), A and D [H], B and C
    [T, G, N], state [H, P, N] (None: zeros). Returns (y [T, H, P], final state), float32."""
    num_heads, head_dim = x.shape[1:]
    B, C = _expand_groups(B, num_heads), _expand_groups(C, num_heads)
    s = torch.zeros(num_heads, head_dim, B.shape[-1]) if state is None else state.float().clone()
    out = torch.empty(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t].float() * A.float())[:, None, None]
        s = s * decay + (dt[t].float()[:, None, None] * B[t][:, None, :]) * x[t].float()[..., None]
        out[t] = (s @ C[t][..., None])[..., 0] + D.float()[:, None] * x[t].float()
    return out, s


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: sum of x over (j, i] below the diagonal, -inf above it."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    x = x.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), -1), 0)
    summed = torch.cumsum(x, dim=-2)
    return summed.masked_fill(~torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device)), -torch.inf)


class TorchSSD:
    """The Mamba2 scan in PyTorch ops."""

    name = "torch"

    def chunked(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        state: torch.Tensor | None,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens (shapes as `naive_ssd`); returns (y [T, H, P], final state
        [H, P, N]), float32. transformers' chunked algorithm, op for op, on a batch of one."""
        length, num_heads, head_dim = x.shape
        pad = (chunk_size - length % chunk_size) % chunk_size
        x = x.float()
        B, C = _expand_groups(B, num_heads), _expand_groups(C, num_heads)
        d_residual = D.float()[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
        x = x * dt.float()[..., None]
        a = A.float() * dt.float()

        def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [1, c, l, ...]
            t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
            return t.reshape(1, -1, chunk_size, *t.shape[1:])

        x, a, B, C = chunks(x), chunks(a), chunks(B), chunks(C)
        a = a.permute(0, 3, 1, 2)
        a_cumsum = torch.cumsum(a, dim=-1)
        L = torch.exp(_segment_sum(a))
        G = torch.einsum("bclhn,bcshn->bclsh", C, B)
        M = G * L.permute(0, 2, 3, 4, 1)
        y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
        decay_states = torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum)
        B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
        states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
        previous = torch.zeros_like(states[:, :1]) if state is None else state[None, None].to(dtype=states.dtype)
        states = torch.cat([previous, states], dim=1)
        decay_chunk = torch.exp(_segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
        new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
        states, final = new_states[:, :-1], new_states[:, -1]
        C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
        y_off = C_times_states * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
        y = (y_diag + y_off).reshape(-1, num_heads, head_dim) + d_residual
        return y[:length], final[0]

    def step(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of b sequences: x [b, H, P], dt [b, H] (discretized), B and C
        [b, G, N], states [b, H, P, N]. Returns (y [b, H, P], new states), float32."""
        num_heads = x.shape[1]
        B, C = _expand_groups(B, num_heads), _expand_groups(C, num_heads)
        dt = dt.float()[..., None, None]
        s = state.float() * torch.exp(dt * A.float()[:, None, None]) + (dt * B[:, :, None, :]) * x.float()[..., None]
        y = (s @ C[..., None])[..., 0] + D.float()[:, None] * x.float()
        return y, s
