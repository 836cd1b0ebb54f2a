"""The MoE block's two execution paths (pagoda.kernels.moe over pagoda.model.moe.Experts): the grouped products over
all held experts and the loop over the hit experts compute the same outputs as a per-token
reference, with experts never hit at the start, middle and end of the expert range, with
gpt-oss's biased experts, and whichever path the hit count picks."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import Kernels, moe
from pagoda.kernels.moe import route
from pagoda.model.layers import Linear
from pagoda.model.loader import finalize_linears
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe import SparseMoE
from pagoda.model.parallel import TensorParallelGroup
from pagoda.quant.weight_formats import WeightFormat

HIDDEN, EXPERTS, TOP_K = 32, 24, 2
ALWAYS_GROUPED = EXPERTS  # any hit expert makes the share
NEVER_GROUPED = 0


def moe_block(
    architecture: str, seed: int = 0, weight_format: WeightFormat | None = None, kernels: Kernels | None = None
) -> SparseMoE:
    config = {
        "architectures": [architecture],
        "vocab_size": 64,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_experts_per_tok": TOP_K,
    }
    if architecture == "GptOssForCausalLM":
        config.update(
            num_local_experts=EXPERTS,
            intermediate_size=16,
            swiglu_limit=0.6,
            head_dim=8,
            layer_types=["full_attention"],
        )
    else:
        config.update(num_experts=EXPERTS, intermediate_size=64, moe_intermediate_size=16, norm_topk_prob=True)
    block = SparseMoE(
        ModelConfig.from_dict(config),
        torch.float32,
        torch.device("cpu"),
        weight_format,
        TensorParallelGroup(),
        kernels or Kernels(torch.device("cpu")),
    )
    generator = torch.Generator().manual_seed(seed)
    for parameter in block.parameters():
        parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    finalize_linears(block)
    return block


def reference(block: SparseMoE, hidden: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert."""
    rows = []
    for x in hidden:
        logits = block.gate(x[None]).float()[0]
        if block.softmax_over_top_k:
            top, experts = torch.topk(logits, TOP_K)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, experts = torch.topk(torch.softmax(logits, dim=-1), TOP_K)
            weights = weights / weights.sum()
        rows.append(sum(w * block.experts.run_expert(int(e), x[None])[0] for w, e in zip(weights, experts)))
    return torch.stack(rows)


def route_only_to(block: SparseMoE, experts: list[int]) -> None:
    """A router whose logits for inputs with first feature 1 rank `experts` first, in order."""
    weight = torch.zeros(EXPERTS, HIDDEN)
    for rank, expert in enumerate(experts):
        weight[expert, 0] = 100.0 - 10.0 * rank
    bias = block.gate.bias is not None
    block.gate = Linear(HIDDEN, EXPERTS, bias, torch.float32, torch.device("cpu"))
    block.gate.weight.data.copy_(weight)
    if bias:
        block.gate.bias.data.zero_()
    block.gate.finalize("gate")


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
@pytest.mark.parametrize("share", [ALWAYS_GROUPED, NEVER_GROUPED])
def test_paths_match_reference_with_many_experts_hit(architecture: str, share: int, monkeypatch) -> None:
    monkeypatch.setattr(moe, "GROUPED_MIN_ACTIVE_SHARE", share)
    block = moe_block(architecture)
    hidden = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert int((route(block.gate(hidden), TOP_K, True).counts > 0).sum()) > EXPERTS // 2
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "GptOssForCausalLM"])
@pytest.mark.parametrize("hit", [[0, 1], [7, 12], [22, 23], [23, 0]])
@pytest.mark.parametrize("share", [ALWAYS_GROUPED, NEVER_GROUPED])
def test_experts_never_hit_contribute_nothing(architecture: str, hit: list[int], share: int, monkeypatch) -> None:
    monkeypatch.setattr(moe, "GROUPED_MIN_ACTIVE_SHARE", share)
    block = moe_block(architecture, seed=2)
    route_only_to(block, hit)
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    hidden[:, 0] = 1.0
    counts = route(block.gate(hidden), TOP_K, True).counts.tolist()
    assert [e for e, count in enumerate(counts) if count] == sorted(hit)
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


def test_hit_count_picks_the_path(monkeypatch) -> None:
    """A decode step of one sequence (few experts hit) loops; a batch hitting most experts
    takes the grouped products. Both give the reference's outputs."""
    block = moe_block("Qwen3MoeForCausalLM", seed=4)
    grouped_calls = []
    run_grouped = block.kernels.moe.run_grouped
    monkeypatch.setattr(block.kernels.moe, "run_grouped", lambda *a: grouped_calls.append(1) or run_grouped(*a))
    one = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(block(one), reference(block, one), rtol=1e-5, atol=1e-5)
    assert not grouped_calls
    many = torch.randn(48, HIDDEN, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(block(many), reference(block, many), rtol=1e-5, atol=1e-5)
    assert grouped_calls
