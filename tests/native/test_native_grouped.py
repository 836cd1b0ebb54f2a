"""The native grouped products (a MoE projection over the experts hit; float32 and int8) against
per-group products, and a MoE block running on them against the per-token reference. Tolerances as in
tests/native/test_native_kernels.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagoda import native
from pagoda.kernels import Kernels
from pagoda.quant.weight_formats import Int8Weight, quantize_int8_per_channel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_moe_grouped import HIDDEN, moe_block, reference, route_only_to  # noqa: E402

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
NATIVE = Kernels(torch.device("cpu"), KERNELS)  # every op on the native kernels


@pytest.mark.parametrize("counts", [[0, 3, 0, 17, 1], [5], [0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 40]])
@pytest.mark.parametrize("biased", [False, True])
def test_grouped_product_matches_per_group_linear(counts: list[int], biased: bool) -> None:
    generator = torch.Generator().manual_seed(len(counts) + sum(counts))
    k, n = 70, 37  # tails of the vector width and of the row tiles
    x = torch.randn(sum(counts), k, generator=generator)
    weight = torch.randn(len(counts), n, k, generator=generator)
    bias = torch.randn(len(counts), n, generator=generator) if biased else None
    out = KERNELS.grouped_linear_f32(x, weight, torch.tensor(counts), bias)
    expected = torch.cat(
        [F.linear(rows, weight[g], None if bias is None else bias[g]) for g, rows in enumerate(x.split(counts))]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * k**0.5)


def test_counts_that_do_not_cover_the_rows_are_refused() -> None:
    with pytest.raises(RuntimeError, match="counts sum to 3, x has 4 rows"):
        KERNELS.grouped_linear_f32(torch.randn(4, 8), torch.randn(2, 5, 8), torch.tensor([1, 2]), None)


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
@pytest.mark.parametrize("tokens, hit", [(1, None), (40, None), (5, [23, 0])])
def test_moe_block_on_native_kernels_matches_reference(architecture: str, tokens: int, hit) -> None:
    block = moe_block(architecture, seed=7, kernels=NATIVE)
    if hit is not None:
        route_only_to(block, hit)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    if hit is not None:
        hidden[:, 0] = 1.0
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("biased", [False, True])
def test_grouped_int8_product_matches_per_group_int8_product(biased: bool) -> None:
    generator = torch.Generator().manual_seed(11)
    counts = [0, 4, 0, 1, 19]
    k, padded, n = 40, 48, 21  # int8 rows padded past the inputs, as Int8Weight stores them
    x = torch.randn(sum(counts), k, generator=generator)
    pairs = [quantize_int8_per_channel(torch.randn(n, k, generator=generator)) for _ in counts]
    qweight = torch.stack([F.pad(q, (0, padded - k)) for q, _ in pairs])
    scales = torch.stack([s for _, s in pairs])
    bias = torch.randn(len(counts), n, generator=generator) if biased else None
    out = KERNELS.grouped_linear_int8(x, qweight, scales, torch.tensor(counts), bias)
    expected = torch.cat(
        [
            KERNELS.linear_int8(rows, qweight[g], scales[g], None if bias is None else bias[g])
            for g, rows in enumerate(x.split(counts))
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
def test_int8_experts_run_grouped_and_match_their_linears(architecture: str) -> None:
    block = moe_block(architecture, seed=9, weight_format=Int8Weight(native_layout=True), kernels=NATIVE)
    experts = block.experts
    assert experts.gate_up_qweight is not None and experts.gate_up_qweight.dtype == torch.int8
    # The Linears hold views of the stacked rows: one copy in memory.
    assert experts["3"].gate_up_proj.qweight.data_ptr() == experts.gate_up_qweight[3].data_ptr()
    for tokens in (1, 40):
        hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


def test_float32_experts_take_the_native_product_for_decode_sized_segments() -> None:
    """As FullWeight: native while the segments are decode-sized, torch's grouped product for
    prefill-sized ones (many rows per hit expert); the outputs agree either way."""
    block = moe_block("Qwen3MoeForCausalLM", seed=8, kernels=NATIVE)
    experts, path = block.experts, NATIVE.moe.path
    assert path(experts, torch.empty(1, HIDDEN), rows=2, active=2) == "native"
    assert path(experts, torch.empty(1, HIDDEN), rows=16 * 24, active=24) == "native"
    assert path(experts, torch.empty(1, HIDDEN), rows=16 * 24 + 1, active=24) == "grouped_mm"
    assert path(experts, torch.empty(1, HIDDEN), rows=400, active=2) == "loop"  # few experts, long segments
    for tokens in (4, 300):
        hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)
