"""The native fused-MoE op (a block's experts in one op: grouping, gate/up, activation, down and
the weighted sum) against a per-token torch reference: float32 and int8 experts, biases, SiLU
and gpt-oss's clamped SwiGLU, top-k 1/2/8, every token on one expert, every expert hit, experts
held by another rank; the native top-k routing; the MoE block taking them for decode-sized
inputs; and greedy parity with transformers of the tiny MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss) running on them.

Tolerance: float32 rounding of a different summation order (the dot products are summed in
vector lanes), as tests/native/test_native_kernels.py states it: rtol 1e-5, atol 1e-5 * sqrt(K)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import prompts_for
from model_factory import MOE_ARCHITECTURES, assert_matches_reference, build_model, hf_references
from pagoda import LLM, SamplingParams, native
from pagoda.kernels import Kernels, moe
from pagoda.model.mlp import GatedActivation
from pagoda.quant.weight_formats import Int8Weight, quantize_int8_per_channel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_moe_grouped import HIDDEN, moe_block, reference, route_only_to  # noqa: E402

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
NATIVE = Kernels(torch.device("cpu"), KERNELS)  # every op on the native kernels
H, I = 40, 20  # tails of the vector width and of the row tiles
ALPHA = 1.702


def experts_weights(experts: int, seed: int, int8: bool, biased: bool) -> dict:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * I, H, generator=generator) * 0.3
    down = torch.randn(experts, H, I, generator=generator) * 0.3
    weights = dict(
        gate_up=gate_up,
        down=down,
        gate_up_scales=None,
        down_scales=None,
        gate_up_bias=torch.randn(experts, 2 * I, generator=generator) if biased else None,
        down_bias=torch.randn(experts, H, generator=generator) if biased else None,
    )
    if int8:
        for name, padded in (("gate_up", 48), ("down", 32)):  # int8 rows padded past the inputs, as Int8Weight
            pairs = [quantize_int8_per_channel(w) for w in weights[name]]
            weights[name] = torch.stack([F.pad(q, (0, padded - q.shape[1])) for q, _ in pairs])
            weights[f"{name}_scales"] = torch.stack([s for _, s in pairs])
    return weights


def dequantized(weights: dict, name: str, inputs: int) -> torch.Tensor:
    w = weights[name][..., :inputs].float()
    scales = weights[f"{name}_scales"]
    return w if scales is None else w * scales.unsqueeze(-1)


def reference_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor,
    weights: dict,
    gated: GatedActivation,
    first_expert: int = 0,
) -> torch.Tensor:
    gate_up, down = dequantized(weights, "gate_up", H), dequantized(weights, "down", I)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), route_weights[t].tolist()):
            local = e - first_expert
            if not 0 <= local < gate_up.shape[0]:
                continue
            bias = weights["gate_up_bias"]
            g, u = F.linear(x[t], gate_up[local], None if bias is None else bias[local]).split(I)
            bias = weights["down_bias"]
            out[t] += w * F.linear(gated(g, u), down[local], None if bias is None else bias[local])
    return out


def fused(
    x: torch.Tensor,
    ids: torch.Tensor,
    route_weights: torch.Tensor,
    weights: dict,
    gated: GatedActivation,
    first_expert: int = 0,
) -> torch.Tensor:
    return KERNELS.fused_moe(
        x,
        ids,
        route_weights,
        weights["gate_up"],
        weights["gate_up_scales"],
        weights["gate_up_bias"],
        weights["down"],
        weights["down_scales"],
        weights["down_bias"],
        first_expert,
        gated.swiglu_limit,
        gated.swiglu_alpha,
    )


def random_routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=generator)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * H**0.5)


GATES = {"silu": GatedActivation("silu"), "clamped_swiglu": GatedActivation("silu", 0.6, ALPHA)}


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("gate", list(GATES))
def test_fused_moe_matches_reference(top_k: int, int8: bool, biased: bool, gate: str) -> None:
    weights = experts_weights(10, seed=top_k, int8=int8, biased=biased)
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1))
    ids, route_weights = random_routing(13, 10, top_k, seed=top_k + 1)
    assert_close(
        fused(x, ids, route_weights, weights, GATES[gate]), reference_moe(x, ids, route_weights, weights, GATES[gate])
    )


@pytest.mark.parametrize("int8", [False, True])
def test_every_token_on_one_expert(int8: bool) -> None:
    weights = experts_weights(6, seed=3, int8=int8, biased=True)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(2))
    ids = torch.full((16, 1), 4)
    route_weights = torch.ones(16, 1)
    assert_close(
        fused(x, ids, route_weights, weights, GATES["silu"]),
        reference_moe(x, ids, route_weights, weights, GATES["silu"]),
    )


def test_every_expert_hit() -> None:
    weights = experts_weights(12, seed=4, int8=False, biased=False)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3))
    ids = torch.stack([torch.arange(12).roll(-t)[:3] for t in range(12)])
    route_weights = torch.rand(12, 3, generator=torch.Generator().manual_seed(4))
    assert set(ids.reshape(-1).tolist()) == set(range(12))
    assert_close(
        fused(x, ids, route_weights, weights, GATES["silu"]),
        reference_moe(x, ids, route_weights, weights, GATES["silu"]),
    )


def test_experts_of_other_ranks_are_skipped() -> None:
    """A rank holding experts 4..9 of 16 adds nothing for the others (expert parallelism)."""
    weights = experts_weights(6, seed=5, int8=False, biased=True)
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(5))
    ids, route_weights = random_routing(7, 16, 2, seed=6)
    ids[0] = torch.tensor([0, 15])  # a token none of this rank's experts serve: a zero row
    out = fused(x, ids, route_weights, weights, GATES["silu"], first_expert=4)
    assert torch.equal(out[0], torch.zeros(H))
    assert_close(out, reference_moe(x, ids, route_weights, weights, GATES["silu"], first_expert=4))


def test_shapes_that_do_not_fit_are_refused() -> None:
    weights = experts_weights(3, seed=6, int8=False, biased=False)
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="topk_weights must be"):
        KERNELS.fused_moe(
            x,
            torch.zeros(2, 2, dtype=torch.long),
            torch.ones(2, 1),
            weights["gate_up"],
            None,
            None,
            weights["down"],
            None,
            None,
            0,
            None,
            ALPHA,
        )
    with pytest.raises(RuntimeError, match="down has 41 outputs, hidden has 40"):
        KERNELS.fused_moe(
            x,
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            weights["gate_up"],
            None,
            None,
            torch.randn(3, H + 1, I),
            None,
            None,
            0,
            None,
            ALPHA,
        )
    with pytest.raises(RuntimeError, match="int8 down needs its scales"):
        KERNELS.fused_moe(
            x,
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            weights["gate_up"].to(torch.int8),
            torch.ones(3, 2 * I),
            None,
            weights["down"].to(torch.int8),
            None,
            None,
            0,
            None,
            ALPHA,
        )


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("tokens, hit", [(1, None), (16, None), (5, [23, 0])])
def test_moe_block_fuses_decode_sized_inputs(architecture: str, int8: bool, tokens: int, hit, monkeypatch) -> None:
    block = moe_block(
        architecture, seed=7, weight_format=Int8Weight(native_layout=True) if int8 else None, kernels=NATIVE
    )
    if hit is not None:
        route_only_to(block, hit)
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    if hit is not None:
        hidden[:, 0] = 1.0
    assert NATIVE.moe.fuses(block.experts, hidden)
    calls = []
    run_fused = NATIVE.moe.run_fused
    monkeypatch.setattr(NATIVE.moe, "run_fused", lambda *a: calls.append(1) or run_fused(*a))
    block.count_experts(True)
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)
    assert calls
    assert sum(block.take_expert_counts()) == tokens * block.top_k


def test_inputs_past_the_limit_take_the_grouped_products(monkeypatch) -> None:
    block = moe_block("Qwen3MoeForCausalLM", seed=8, kernels=NATIVE)
    monkeypatch.setattr(moe, "FUSED_MAX_TOKENS", 4)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    assert not NATIVE.moe.fuses(block.experts, hidden) and NATIVE.moe.fuses(block.experts, hidden[:4])
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


def test_int8_experts_fuse_at_every_row_count_and_do_not_depend_on_the_batch(monkeypatch) -> None:
    block = moe_block("Qwen3MoeForCausalLM", seed=10, weight_format=Int8Weight(native_layout=True), kernels=NATIVE)
    monkeypatch.setattr(moe, "FUSED_MAX_TOKENS", 4)
    hidden = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(10))  # one router product (native)
    assert NATIVE.moe.fuses(block.experts, hidden)
    together = block(hidden)
    assert torch.equal(together[7:8], block(hidden[7:8]))  # one token alone: the same bits
    torch.testing.assert_close(together, reference(block, hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_greedy_parity_with_transformers_on_the_fused_op(tmp_path: Path, architecture: str) -> None:
    directory = build_model(tmp_path / architecture, architecture)
    prompts, references = hf_references(directory, lambda vocab: prompts_for(vocab, (3, 11, 40), seed=1), 16)
    llm = LLM(model=str(directory), native_kernels="on")
    fused_calls = []
    moe_kernels = llm.engine.core.kernels.moe  # the one every layer calls
    run_fused = moe_kernels.run_fused
    moe_kernels.run_fused = lambda *a: fused_calls.append(1) or run_fused(*a)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    assert_matches_reference(llm.generate(prompts, greedy), references, 2e-5)
    assert fused_calls  # the decode steps ran on the fused op


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("renormalize, softmax_over_top_k", [(True, False), (False, False), (False, True)])
def test_routing_matches_top_k_experts(top_k: int, renormalize: bool, softmax_over_top_k: bool) -> None:
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(top_k)) * 3
    weights, experts = KERNELS.route_top_k(logits, top_k, renormalize, softmax_over_top_k)
    expected_weights, expected_experts = moe.top_k_experts(logits, top_k, renormalize, softmax_over_top_k)
    assert torch.equal(experts, expected_experts)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_routing_refuses_a_top_k_past_the_experts() -> None:
    with pytest.raises(RuntimeError, match="top_k 5 of 4 experts"):
        KERNELS.route_top_k(torch.randn(2, 4), 5, True, False)
