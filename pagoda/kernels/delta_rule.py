"""The gated delta rule (Gated DeltaNet's linear attention), per device: the chunked form for a
prompt's tokens and the single-step update for decoding.

One head's recurrent state S [Dk, Dv] evolves per token t as
    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t
with q and k L2-normalized and q scaled by Dk^-0.5. The chunked form (transformers'
`torch_chunk_gated_delta_rule`, after flash-linear-attention) computes the same in chunks of
`chunk_size` tokens with a triangular solve per chunk; `naive_gated_delta_rule` is the per-token
loop every implementation is tested against. Everything runs in float32, as transformers does:
the state is kept in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # flash-linear-attention's (and transformers') form: eps inside the square root
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(query: torch.Tensor, key: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] -> float32 [T, Hv, Dk], each key head serving Hv / Hk value heads;
    L2-normalized, q scaled by Dk^-0.5."""
    repeat = num_v_heads // query.shape[1]
    if repeat != 1:
        query = query.repeat_interleave(repeat, dim=1)
        key = key.repeat_interleave(repeat, dim=1)
    query, key = _l2norm(query.float()), _l2norm(key.float())
    return query * query.shape[-1] ** -0.5, key


def naive_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, token by token: q, k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv], state
    [Hv, Dk, Dv] (None: zeros). Returns (output [T, Hv, Dv] float32, final state float32)."""
    num_v_heads, v_dim = value.shape[1:]
    q, k = _prepare(query, key, num_v_heads)
    v, g, beta = value.float(), g.float(), beta.float()
    s = torch.zeros(num_v_heads, q.shape[-1], v_dim) if state is None else state.float().clone()
    out = torch.empty(q.shape[0], num_v_heads, v_dim)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = (s * k[t].unsqueeze(-1)).sum(dim=-2)
        s = s + k[t].unsqueeze(-1) * ((v[t] - predicted) * beta[t].unsqueeze(-1)).unsqueeze(-2)
        out[t] = (s * q[t].unsqueeze(-1)).sum(dim=-2)
    return out, s


class TorchDeltaRule:
    """The gated delta rule in PyTorch ops."""

    name = "torch"

    def chunked(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
        chunk_size: int = 64,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0) and beta
        [T, Hv], the state before them [Hv, Dk, Dv] (None: zeros). Returns (output [T, Hv, Dv],
        final state [Hv, Dk, Dv]), both float32. transformers' chunked algorithm, op for op."""
        length = query.shape[0]
        num_v_heads, v_dim = value.shape[1:]
        q, k = _prepare(query, key, num_v_heads)
        # [Hv, T, ...]
        q, k = q.transpose(0, 1), k.transpose(0, 1)
        v = value.float().transpose(0, 1)
        beta, decay = beta.float().transpose(0, 1), g.float().transpose(0, 1)
        pad = (chunk_size - length % chunk_size) % chunk_size
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, decay = F.pad(beta, (0, pad)), F.pad(decay, (0, pad))
        num_chunks = (length + pad) // chunk_size
        v_beta = v * beta.unsqueeze(-1)
        k_beta = k * beta.unsqueeze(-1)
        q, k, k_beta, v_beta = (
            x.reshape(num_v_heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
        )
        decay = decay.reshape(num_v_heads, num_chunks, chunk_size)
        upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
        cum = decay.cumsum(dim=-1)
        pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
        system = (k_beta @ k.transpose(-1, -2)) * pairwise
        intra = (q @ k.transpose(-1, -2)) * pairwise
        decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
        new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
        s = torch.zeros(num_v_heads, q.shape[-1], v_dim, device=q.device) if state is None else state.to(torch.float32)
        out = torch.zeros_like(new_values)
        q = q * cum.exp().unsqueeze(-1)
        k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
        chunk_decay = cum[..., -1].exp()[..., None, None]
        for i in range(num_chunks):
            v_new = new_values[:, i] - k_cumdecay[:, i] @ s
            out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
            s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
        out = out.reshape(num_v_heads, -1, v_dim)[:, :length]
        return out.transpose(0, 1).contiguous(), s

    def step(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta [B, Hv],
        their states [B, Hv, Dk, Dv]. Returns (output [B, Hv, Dv], new states), float32."""
        q, k = _prepare(query, key, value.shape[1])
        s = state.float() * g.float().exp()[..., None, None]
        predicted = (s * k.unsqueeze(-1)).sum(dim=-2)
        delta = (value.float() - predicted) * beta.float().unsqueeze(-1)
        s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
        return (s * q.unsqueeze(-1)).sum(dim=-2), s
