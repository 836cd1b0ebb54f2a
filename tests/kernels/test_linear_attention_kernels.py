"""The gated delta rule and the short causal convolution (pagoda.kernels.delta_rule,
pagoda.kernels.causal_conv) against their per-token references: the chunked form over lengths
around the chunk size, from zeros and from a carried state, two key heads serving four value
heads; the single-step update over a batch; the convolution over a prompt cut in two chunks and
token by token; and the chunked form against transformers' own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.kernels.causal_conv import TorchCausalConv, naive_causal_conv
from pagoda.kernels.delta_rule import TorchDeltaRule, naive_gated_delta_rule

HK, HV, DK, DV = 2, 4, 8, 6


def inputs(length: int, seed: int = 0, batch: int | None = None):
    generator = torch.Generator().manual_seed(seed)
    lead = (length,) if batch is None else (batch,)
    q = torch.randn(*lead, HK, DK, generator=generator)
    k = torch.randn(*lead, HK, DK, generator=generator)
    v = torch.randn(*lead, HV, DV, generator=generator)
    g = -F.softplus(torch.randn(*lead, HV, generator=generator))
    beta = torch.rand(*lead, HV, generator=generator)
    return q, k, v, g, beta


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("carried", [False, True])
def test_chunked_delta_rule_matches_the_per_token_loop(length: int, carried: bool) -> None:
    q, k, v, g, beta = inputs(length)
    state = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(3)) if carried else None
    out, final = TorchDeltaRule().chunked(q, k, v, g, beta, state, chunk_size=16)
    want, want_final = naive_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)


def test_single_step_matches_the_per_token_loop_for_each_sequence() -> None:
    q, k, v, g, beta = inputs(1, seed=1, batch=3)
    states = torch.randn(3, HV, DK, DV, generator=torch.Generator().manual_seed(4))
    out, new = TorchDeltaRule().step(q, k, v, g, beta, states)
    for b in range(3):
        want, want_state = naive_gated_delta_rule(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], states[b]
        )
        torch.testing.assert_close(out[b], want[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(new[b], want_state, atol=1e-6, rtol=1e-5)


def test_chunked_delta_rule_matches_transformers() -> None:
    reference = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = inputs(70, seed=2)
    state = torch.randn(HV, DK, DV, generator=torch.Generator().manual_seed(5))
    out, final = TorchDeltaRule().chunked(q, k, v, g, beta, state)
    want, want_final = reference.torch_chunk_gated_delta_rule(
        *(x.unsqueeze(0) for x in (q, k, v)),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=state.unsqueeze(0),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(final, want_final[0], atol=1e-6, rtol=1e-6)


def test_causal_conv_in_chunks_and_steps_matches_the_per_token_loop() -> None:
    generator = torch.Generator().manual_seed(6)
    channels, width, length = 10, 4, 9
    x = torch.randn(length, channels, generator=generator)
    weight = torch.randn(channels, width, generator=generator)
    bias = torch.randn(channels, generator=generator)
    want, want_window = naive_causal_conv(x, None, weight, bias)
    conv = TorchCausalConv()
    first, window = conv.prefill(x[:2], None, weight, bias)  # shorter than the window
    second, window = conv.prefill(x[2:6], window, weight, bias)
    outs = [first, second]
    windows = window.unsqueeze(0)
    for t in range(6, length):
        y, windows = conv.step(x[t : t + 1], windows, weight, bias)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(windows[0], want_window)
    no_bias, _ = conv.prefill(x, None, weight, None)
    torch.testing.assert_close(no_bias, naive_causal_conv(x, None, weight, None)[0], atol=1e-6, rtol=1e-6)


def ssd_inputs(length: int, seed: int = 0, batch: int | None = None):
    from pagoda.kernels.ssd import discretize

    generator = torch.Generator().manual_seed(seed)
    lead = (length,) if batch is None else (batch,)
    x = torch.randn(*lead, 4, 3, generator=generator)
    dt = discretize(torch.randn(*lead, 4, generator=generator), torch.ones(4), (0.0, float("inf")))
    A = -torch.arange(1, 5, dtype=torch.float32)
    B = torch.randn(*lead, 2, 5, generator=generator)  # two groups of two heads
    C = torch.randn(*lead, 2, 5, generator=generator)
    D = torch.rand(4, generator=generator)
    return x, dt, A, B, C, D


@pytest.mark.parametrize("length", [1, 7, 16, 37])
@pytest.mark.parametrize("carried", [False, True])
def test_chunked_ssd_matches_the_per_token_loop(length: int, carried: bool) -> None:
    from pagoda.kernels.ssd import TorchSSD, naive_ssd

    x, dt, A, B, C, D = ssd_inputs(length)
    state = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(9)) if carried else None
    out, final = TorchSSD().chunked(x, dt, A, B, C, D, state, chunk_size=16)
    want, want_final = naive_ssd(x, dt, A, B, C, D, state)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)


def test_ssd_step_matches_the_per_token_loop_for_each_sequence() -> None:
    from pagoda.kernels.ssd import TorchSSD, naive_ssd

    x, dt, A, B, C, D = ssd_inputs(1, seed=3, batch=3)
    states = torch.randn(3, 4, 3, 5, generator=torch.Generator().manual_seed(10))
    out, new = TorchSSD().step(x, dt, A, B, C, D, states)
    for b in range(3):
        want, want_state = naive_ssd(x[b : b + 1], dt[b : b + 1], A, B[b : b + 1], C[b : b + 1], D, states[b])
        torch.testing.assert_close(out[b], want[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(new[b], want_state, atol=1e-6, rtol=1e-5)
