"""The MoE block's grouped op (pagoda.model.moe) against a per-token reference: every token's
output is sum_k weight_k * expert_k(x), whichever experts the batch hits."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import Kernels
from pagoda.kernels.moe import route
from pagoda.model.layers import Linear
from pagoda.model.loader import finalize_linears
from pagoda.model.model_config import ModelConfig
from pagoda.model.moe import SparseMoE
from pagoda.model.parallel import TensorParallelGroup

HIDDEN, EXPERTS, TOP_K = 32, 6, 2


def moe_block(shared: bool, renormalize: bool, seed: int = 0) -> SparseMoE:
    config = ModelConfig.from_dict(
        {
            "architectures": ["Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM"],
            "vocab_size": 64,
            "hidden_size": HIDDEN,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24 if shared else 0,
            "norm_topk_prob": renormalize,
        }
    )
    block = SparseMoE(
        config, torch.float32, torch.device("cpu"), None, TensorParallelGroup(), Kernels(torch.device("cpu"))
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
        probs = torch.softmax(block.gate(x[None]).float(), dim=-1)[0]
        weights, experts = torch.topk(probs, TOP_K)
        if block.renormalize:
            weights = weights / weights.sum()
        out = sum(w * block.experts.run_expert(int(e), x[None])[0] for w, e in zip(weights, experts))
        if block.shared_expert is not None:
            out = out + torch.sigmoid(block.shared_expert_gate(x[None]))[0] * block.shared_expert(x[None])[0]
        rows.append(out)
    return torch.stack(rows)


def steer_router_to(block: SparseMoE, favourite: int) -> None:
    """A router that puts `favourite` first and the next expert second for every input whose
    first feature is 1."""
    weight = torch.zeros(EXPERTS, HIDDEN)
    weight[favourite, 0] = 100.0
    weight[(favourite + 1) % EXPERTS, 0] = 50.0
    block.gate = Linear(HIDDEN, EXPERTS, False, torch.float32, torch.device("cpu"))
    block.gate.weight.data.copy_(weight)
    block.gate.finalize("gate")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_op_matches_per_token_reference_with_every_expert_hit(shared: bool, renormalize: bool) -> None:
    block = moe_block(shared, renormalize)
    hidden = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(1))
    routing = route(block.gate(hidden), TOP_K, renormalize)
    assert (routing.counts > 0).all()  # every expert serves some token
    assert int(routing.counts.sum()) == 40 * TOP_K
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


def test_all_tokens_routed_to_one_expert() -> None:
    block = moe_block(shared=True, renormalize=True)
    steer_router_to(block, favourite=4)
    hidden = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2))
    hidden[:, 0] = 1.0
    routing = route(block.gate(hidden), TOP_K, True)
    assert routing.counts.tolist() == [0, 0, 0, 0, 9, 9]  # every token's two experts: 4 and 5
    torch.testing.assert_close(block(hidden), reference(block, hidden), rtol=1e-5, atol=1e-5)


def test_single_token_and_empty_batches() -> None:
    block = moe_block(shared=False, renormalize=False)
    one = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(block(one), reference(block, one), rtol=1e-5, atol=1e-5)
    assert block(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def test_expert_counts_accumulate_until_taken() -> None:
    block = moe_block(shared=False, renormalize=False)
    assert block.take_expert_counts() == [0] * EXPERTS  # not counting
    block.count_experts(True)
    hidden = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(4))
    block(hidden)
    block(hidden)
    counts = block.take_expert_counts()
    assert sum(counts) == 2 * 10 * TOP_K
    assert block.take_expert_counts() == [0] * EXPERTS
