"""The native residual+RMSNorm and rotary kernels against pagoda's PyTorch path.

Tolerances: the rotation computes the same float32 products and sums as the PyTorch path (no fused
multiply-add), so it is compared exactly. The norm adds the squares in another order (16-wide
partial sums), so it agrees to a few ulps: |native - torch| <= 1e-6 * (1 + |torch|) elementwise
(the scale 1/rms carries the relative error of the sum, about D * 2^-24 at worst).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import prompts_for as engine_prompts
from model_factory import MORE_ARCHITECTURES, assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams, native
from pagoda.kernels import Kernels
from pagoda.model.layers import RMSNorm, RotaryEmbedding

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
NATIVE = Kernels(torch.device("cpu"), KERNELS)  # every op on the native kernels
RTOL = ATOL = 1e-6
SIZES = [1, 7, 16, 33, 64, 256, 1000]  # vector widths and their tails
EPS = 1e-6


def reference_norm(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, 1.0 + weight if unit_offset else weight, EPS)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dim", SIZES)
def test_rms_norm_matches_torch(dim, unit_offset):
    generator = torch.Generator().manual_seed(dim)
    for tokens in (1, 5, 300):  # 300 rows of 1000: split over threads
        x, weight = torch.randn(tokens, dim, generator=generator), torch.randn(dim, generator=generator)
        expected = reference_norm(x, weight, unit_offset)
        assert_close(KERNELS.rms_norm(x, weight, EPS, unit_offset), expected)
        in_place = x.clone()
        KERNELS.rms_norm_(in_place, weight, EPS, unit_offset)
        assert_close(in_place, expected)


def test_rms_norm_in_place_on_heads_of_a_fused_output():
    """Per-head norms (Qwen3, Gemma 3) read the q or k columns of the qkv output, a strided view."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, (4 + 2 + 2) * 32, generator=generator)
    weight = torch.randn(32, generator=generator)
    k = qkv[:, 4 * 32 : 6 * 32].view(3, 2, 32)
    expected_k = reference_norm(k, weight, False)
    assert_close(KERNELS.rms_norm(k, weight, EPS, False), expected_k)  # read in place, written contiguous
    untouched = qkv.clone()
    KERNELS.rms_norm_(k, weight, EPS, False)
    assert_close(k, expected_k)
    torch.testing.assert_close(qkv[:, : 4 * 32], untouched[:, : 4 * 32], rtol=0, atol=0)
    torch.testing.assert_close(qkv[:, 6 * 32 :], untouched[:, 6 * 32 :], rtol=0, atol=0)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dim", SIZES)
def test_add_rms_norm_matches_torch(dim, gemma):
    generator = torch.Generator().manual_seed(dim + 1)
    for tokens in (1, 9, 300):
        x, residual = torch.randn(tokens, dim, generator=generator), torch.randn(tokens, dim, generator=generator)
        weight, pre_weight = torch.randn(dim, generator=generator), torch.randn(dim, generator=generator)
        added = (reference_norm(x, pre_weight, True) if gemma else x) + residual
        expected = reference_norm(added, weight, gemma)
        residual_before = residual.clone()
        out = KERNELS.add_rms_norm_(x, residual, weight, EPS, gemma, pre_weight if gemma else None)
        if gemma:
            assert_close(x, added)
        else:  # a plain add: exact
            torch.testing.assert_close(x, added, rtol=0, atol=0)
        assert_close(out, expected)
        torch.testing.assert_close(residual, residual_before, rtol=0, atol=0)


def scaling_of(rope_type: str | None, head_dim: int) -> dict | None:
    half = head_dim // 2
    if rope_type == "yarn":
        return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    if rope_type == "longrope":
        return {
            "rope_type": "longrope",
            "short_factor": [1.0 + i / half for i in range(half)],
            "long_factor": [2.0 + 3 * i / half for i in range(half)],
            "original_max_position_embeddings": 32,
            "max_position_embeddings": 128,
        }
    return None


@pytest.mark.parametrize("rope_type", [None, "yarn", "longrope"])
@pytest.mark.parametrize("head_dim", [8, 32, 64, 96])
def test_rotary_in_place_on_fused_qkv_is_exact(head_dim, rope_type):
    """q and k heads rotated in place inside the fused qkv output equal the PyTorch rotation bit for
    bit, from the same tables (LongRoPE's long rows, YaRN's attention factor); v is left alone."""
    scaling = scaling_of(rope_type, head_dim)
    boundary = 32 if rope_type == "longrope" else None
    args = (head_dim, 128, 10000.0, scaling, torch.float32, torch.device("cpu"), boundary)
    reference, rotary = RotaryEmbedding(*args), RotaryEmbedding(*args, kernels=NATIVE)
    generator = torch.Generator().manual_seed(head_dim)
    heads, kv_heads = 6, 2
    qk_size = (heads + kv_heads) * head_dim
    for tokens in (1, 4, 200):
        qkv = torch.randn(tokens, qk_size + kv_heads * head_dim, generator=generator)
        rows = torch.randint(0, 128 + (boundary or 0), (tokens,), generator=generator)
        cos, sin_rolled = rotary.tables(rows)
        expected = reference(qkv[:, :qk_size].reshape(tokens, heads + kv_heads, head_dim), cos, sin_rolled)
        v = qkv[:, qk_size:].clone()
        rotated = rotary(qkv[:, :qk_size].view(tokens, heads + kv_heads, head_dim), cos, sin_rolled)
        assert rotated.data_ptr() == qkv.data_ptr()  # in place, no copy
        torch.testing.assert_close(qkv[:, :qk_size].view(tokens, heads + kv_heads, head_dim), expected, rtol=0, atol=0)
        torch.testing.assert_close(qkv[:, qk_size:], v, rtol=0, atol=0)


def test_layers_take_the_native_path_and_agree():
    """RMSNorm and RotaryEmbedding with the kernels give the PyTorch path's results; bf16 stays on PyTorch."""
    generator = torch.Generator().manual_seed(5)
    plain = RMSNorm(64, EPS, torch.float32, torch.device("cpu"))
    fused = RMSNorm(64, EPS, torch.float32, torch.device("cpu"), kernels=NATIVE)
    fused.weight.copy_(torch.randn(64, generator=generator))
    plain.weight.copy_(fused.weight)
    x, residual = torch.randn(3, 64, generator=generator), torch.randn(3, 64, generator=generator)
    assert_close(fused(x), plain(x))
    expected_out, expected_residual = plain(x.clone(), residual)
    out, new_residual = fused(x.clone(), residual)
    assert_close(out, expected_out)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    half = RMSNorm(64, EPS, torch.bfloat16, torch.device("cpu"), kernels=NATIVE)
    half.weight.copy_(fused.weight)
    assert half(x.bfloat16()).dtype == torch.bfloat16


def test_kernel_families_are_read_from_the_build():
    families = native.kernel_families()
    assert any("RMSNorm" in family and "rotary" in family for family in families)
    assert all(family in KERNELS.describe() for family in families)


# Gemma's (1 + w) norms around attention and MLP, Gemma 3's q/k norms and rope bases, Phi-3's fused
# checkpoint and LongRoPE (both sides of its boundary), a MoE block's output into the fused add, gpt-oss's
# YaRN; Llama, Qwen2/3 and Mistral with the kernels on are tests/model/test_model_correctness.py's.
# float32 rounding of the norm's sum order only.
PARITY_TOLERANCE = 2e-5
PARITY_TOKENS = 24


@pytest.mark.parametrize("architecture", [*MORE_ARCHITECTURES, "qwen3_moe", "gpt_oss"])
def test_greedy_parity_with_transformers_with_the_kernels_on(tmp_path, architecture):
    extra = {"max_position_embeddings": 128, "original_max_position_embeddings": 32} if architecture == "phi3" else {}
    directory = build_model(tmp_path / architecture, architecture, **extra)
    prompts, references = hf_references(
        directory, lambda vocab: engine_prompts(vocab, (3, 11, 40, 57), seed=1), PARITY_TOKENS
    )
    llm = LLM(model=str(directory), native_kernels="on", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_TOKENS, ignore_eos=True, logprobs=0)
    assert_matches_reference(llm.generate(prompts, params), references, PARITY_TOLERANCE)
