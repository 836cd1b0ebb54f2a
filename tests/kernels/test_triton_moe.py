"""The Triton fused-MoE kernel (pagoda/kernels/triton/fused_moe.py) against the torch reference.

With a GPU it runs compiled; without one under Triton's interpreter (TRITON_INTERPRET=1), in
float32 and float16 (the interpreter cannot multiply bfloat16 in `tl.dot`), with tiny shapes
chosen off the kernel's block sizes (partial row blocks, K and N tails). The MoE block's CUDA
branch is exercised on CPU by sending its experts down the "triton" path.
PAGODA_TRITON_COMPILE=1 also lowers every kernel variant to sm_80 / sm_90 binaries (no GPU needed).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from triton_compile import compile_for_gpu
from triton_import import import_triton_module

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"

kernels = import_triton_module("pagoda.kernels.triton.fused_moe", interpret=INTERPRET)

from pagoda.kernels import Kernels  # noqa: E402
from pagoda.kernels.moe import route  # noqa: E402
from pagoda.model.loader import finalize_linears  # noqa: E402
from pagoda.model.model_config import ModelConfig  # noqa: E402
from pagoda.model.moe import SparseMoE  # noqa: E402
from pagoda.model.parallel import TensorParallelGroup  # noqa: E402
from pagoda.quant.weight_formats import Int8Weight, WeightFormat, quantize_int8_per_channel  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS = 40, 24, 8
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-2, atol=2e-2),
    torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def pairs_for(experts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_index, route weights, counts) of top-k choices [T, k] sorted by expert, as pagoda.kernels.moe.route."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // experts.shape[1], weights.reshape(-1)[order], torch.bincount(flat, minlength=EXPERTS)


def reference(hidden, token_index, route_weights, counts, gate_up, down, gate_up_bias, down_bias, first_expert=0):
    """Pair by pair in float32, summed per token; experts outside first_expert .. + len(gate_up)
    add nothing."""
    expert_of_pair = torch.repeat_interleave(torch.arange(EXPERTS), counts)
    rows = []
    for pair, token in enumerate(token_index.tolist()):
        e = int(expert_of_pair[pair]) - first_expert
        if not 0 <= e < gate_up.shape[0]:
            rows.append(torch.zeros(HIDDEN))
            continue
        x = gate_up[e].float() @ hidden[token].float()
        if gate_up_bias is not None:
            x = x + gate_up_bias[e].float()
        gate, up = x.split(x.shape[0] // 2)
        y = down[e].float() @ silu_and_mul(gate, up)
        if down_bias is not None:
            y = y + down_bias[e].float()
        rows.append(y * route_weights[pair])
    return torch.zeros(hidden.shape[0], HIDDEN).index_add_(0, token_index, torch.stack(rows))


def choices(case: str, tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    if case == "one_expert":
        return torch.full((tokens, 1), 5)
    if case == "every_expert":  # each expert hit, some by many rows (ragged segments)
        return torch.stack([torch.randperm(EXPERTS, generator=generator)[:top_k] for _ in range(tokens)])
    # ragged: a skewed router, experts 0 and 3 never hit
    probs = torch.tensor([0.0, 6.0, 1.0, 0.0, 1.0, 2.0, 0.5, 3.0])
    return torch.stack([torch.multinomial(probs, top_k, generator=generator) for _ in range(tokens)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case,tokens,top_k",
    [("one_expert", 70, 1), ("every_expert", 5, 8), ("every_expert", 37, 2), ("ragged", 9, 1), ("ragged", 6, 4)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_experts_match_reference(dtype, case, tokens, top_k, bias):
    generator = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts = choices(case, tokens, top_k, generator)
    weights = torch.softmax(torch.randn(experts.shape, generator=generator), dim=-1)
    token_index, route_weights, counts = pairs_for(experts, weights)
    hidden = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) * 0.2).to(dtype)
    gate_up_bias = torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=generator).to(dtype) if bias else None
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=generator).to(dtype) if bias else None
    expected = reference(hidden, token_index, route_weights, counts, gate_up, down, gate_up_bias, down_bias)

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DEVICE)

    stacked = kernels.ExpertWeights(on(gate_up), on(down), on(gate_up_bias), on(down_bias))
    got = kernels.grouped_experts(on(hidden), on(token_index), on(route_weights), on(counts), stacked, silu_and_mul)
    assert got.dtype == dtype and got.shape == (tokens, HIDDEN)
    torch.testing.assert_close(got.float().cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("first_expert,held", [(0, 3), (3, 3), (6, 2)])
def test_a_rank_holding_some_experts_computes_theirs_and_zeros_for_the_rest(first_expert, held):
    generator = torch.Generator().manual_seed(first_expert)
    tokens, top_k = 10, 3
    experts = choices("every_expert", tokens, top_k, generator)
    weights = torch.softmax(torch.randn(experts.shape, generator=generator), dim=-1)
    token_index, route_weights, counts = pairs_for(experts, weights)
    hidden = torch.randn(tokens, HIDDEN, generator=generator)
    gate_up = torch.randn(held, 2 * INTERMEDIATE, HIDDEN, generator=generator) * 0.2
    down = torch.randn(held, HIDDEN, INTERMEDIATE, generator=generator) * 0.2
    gate_up_bias, down_bias = torch.randn(held, 2 * INTERMEDIATE, generator=generator), torch.randn(held, HIDDEN)
    expected = reference(
        hidden, token_index, route_weights, counts, gate_up, down, gate_up_bias, down_bias, first_expert
    )
    stacked = kernels.ExpertWeights(*(t.to(DEVICE) for t in (gate_up, down, gate_up_bias, down_bias)))
    got = kernels.grouped_experts(
        *(t.to(DEVICE) for t in (hidden, token_index, route_weights, counts)), stacked, silu_and_mul, first_expert
    )
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_experts_match_dequantized_reference(dtype):
    generator = torch.Generator().manual_seed(3)
    in_features, out_features, rows = 40, 72, 11
    weight = torch.randn(EXPERTS, out_features, in_features, generator=generator) * 0.1
    quantized = [quantize_int8_per_channel(w) for w in weight]
    # Rows padded to a multiple of 16 as the int8 format stores them; the kernel reads in_features.
    qweight = torch.stack([F.pad(q, (0, -in_features % 16)) for q, _ in quantized])
    scales = torch.stack([s for _, s in quantized]).to(dtype if dtype != torch.float32 else torch.bfloat16)
    bias = torch.randn(EXPERTS, out_features, generator=generator).to(dtype)
    counts = torch.tensor([0, 4, 0, 0, 1, 0, 6, 0])
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    blocks = kernels.align_blocks(counts.to(DEVICE), rows, 16)
    got = kernels.grouped_linear(
        x.to(DEVICE),
        qweight.to(DEVICE),
        blocks,
        scales=scales.to(DEVICE),
        bias=bias.to(DEVICE),
        in_features=in_features,
    )
    expert_of_row = torch.repeat_interleave(torch.arange(EXPERTS), counts)
    dequantized = torch.stack([q.float() for q, _ in quantized]) * scales.float()[..., None]
    expected = torch.einsum("rk,rnk->rn", x.float(), dequantized[expert_of_row]) + bias.float()[expert_of_row]
    torch.testing.assert_close(got.float().cpu(), expected, **TOLERANCE[dtype])


def test_align_blocks_pads_each_segment_and_skips_experts_not_hit(monkeypatch):
    counts = torch.tensor([0, 3, 0, 17, 16, 0])
    # Sized from the pair and expert counts only: no value goes back to the host (CUDA graphs).
    for method in ("tolist", "item", "__bool__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, method, lambda *args: pytest.fail("a host sync"))
    blocks = kernels.align_blocks(counts, 36, 16)
    monkeypatch.undo()
    assert blocks.num_pairs == 36 and blocks.block_m == 16
    # 36 // 16 + 6 experts = 8 blocks in the grid, 4 real ones.
    assert blocks.block_expert.tolist() == [1, 3, 3, 4, -1, -1, -1, -1]
    rows = blocks.block_rows.view(8, 16).tolist()
    pad = blocks.num_pairs
    assert rows[0] == [0, 1, 2] + [pad] * 13
    assert rows[1] == list(range(3, 19)) and rows[2] == [19] + [pad] * 15
    assert rows[3] == list(range(20, 36))
    assert all(row == [pad] * 16 for row in rows[4:])
    assert kernels.pick_block_m(4, 4) == 16 and kernels.pick_block_m(60, 2) == 32 and kernels.pick_block_m(640, 8) == 64
    assert kernels.pick_block_m(128, 128) == 16  # a decode step of 16 tokens, top-8 of 128 experts


def moe_block(
    architecture: str, top_k: int, dtype: torch.dtype, weight_format: WeightFormat | None = None
) -> SparseMoE:
    config = {
        "architectures": [architecture],
        "vocab_size": 64,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_experts_per_tok": top_k,
    }
    if architecture == "GptOssForCausalLM":  # biased experts, clamped SwiGLU, router bias
        config.update(
            num_local_experts=EXPERTS,
            intermediate_size=INTERMEDIATE,
            swiglu_limit=0.6,
            head_dim=8,
            layer_types=["full_attention"],
        )
    else:
        config.update(
            num_experts=EXPERTS, intermediate_size=64, moe_intermediate_size=INTERMEDIATE, norm_topk_prob=True
        )
    block = SparseMoE(
        ModelConfig.from_dict(config), dtype, DEVICE, weight_format, TensorParallelGroup(), Kernels(DEVICE)
    )
    generator = torch.Generator().manual_seed(top_k)
    for parameter in block.parameters():
        parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    finalize_linears(block)
    return block


@pytest.mark.parametrize("architecture,top_k", [("Qwen3MoeForCausalLM", 8), ("GptOssForCausalLM", 2)])
def test_moe_block_on_the_triton_path_matches_the_loop(architecture, top_k, monkeypatch):
    block = moe_block(architecture, top_k, torch.float32)
    hidden = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    moe_kernels = block.kernels.moe
    monkeypatch.setattr(moe_kernels, "path", lambda experts, hidden, rows, active: "loop")
    expected = block(hidden)
    calls = []
    monkeypatch.setattr(moe_kernels, "triton", kernels)  # the interpreted kernels, on the CPU too
    run_triton = moe_kernels.run_triton
    monkeypatch.setattr(moe_kernels, "runs_triton", lambda experts, hidden: True)
    monkeypatch.setattr(moe_kernels, "run_triton", lambda *args: calls.append(1) or run_triton(*args))
    torch.testing.assert_close(block(hidden), expected, rtol=1e-5, atol=1e-5)
    assert calls


@pytest.mark.skipif(INTERPRET, reason="the experts take the Triton path on CUDA devices only")
@pytest.mark.parametrize(
    "dtype,weight_format", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, Int8Weight())]
)
def test_moe_block_picks_triton_on_cuda(dtype, weight_format):
    block = moe_block("GptOssForCausalLM", 2, dtype, weight_format)
    hidden = torch.randn(9, HIDDEN, device=DEVICE, dtype=dtype)
    assert block.kernels.moe.runs_triton(block.experts, hidden)
    routing = route(block.gate(hidden), 2, True, block.softmax_over_top_k)
    expected = torch.zeros_like(hidden, dtype=torch.float32)
    for row, (token, weight) in enumerate(zip(routing.token_index.tolist(), routing.weights.tolist())):
        expert = int(torch.repeat_interleave(torch.arange(EXPERTS, device=DEVICE), routing.counts)[row])
        expected[token] += weight * block.experts.run_expert(expert, hidden[token : token + 1])[0].float()
    torch.testing.assert_close(
        block.kernels.moe.run_routed(block.experts, hidden, routing).float(), expected, **TOLERANCE[dtype]
    )


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_moe_block_on_cuda_replays_in_a_cuda_graph():
    block = moe_block("Qwen3MoeForCausalLM", 8, torch.bfloat16)
    static = torch.randn(16, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles the kernels before the capture
        block(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = block(static)
    fresh = torch.randn(16, HIDDEN, device=DEVICE, dtype=torch.bfloat16)  # other experts hit, same shapes
    static.copy_(fresh)
    graph.replay()
    torch.testing.assert_close(captured, block(fresh))


COMPILE_FOR_GPU = r"""
import torch
from triton_compile import arch_and_dtype, compiling
from pagoda.kernels.triton import fused_moe as tm

dtype = arch_and_dtype()[1]

tm._grouped_expert_kernel = compiling(tm._grouped_expert_kernel)
hidden_size, intermediate, experts = 2048, 768, 16
for tokens, top_k in ((4, 8), (64, 8), (1024, 8)):  # the three row-block sizes
    counts = torch.full((experts,), tokens * top_k // experts)
    hidden = torch.empty(tokens, hidden_size, dtype=dtype)
    token_index = torch.zeros(tokens * top_k, dtype=torch.int64)
    route_weights = torch.empty(tokens * top_k, dtype=torch.float32)
    for bias in (False, True) if tokens == 64 else (False,):  # bias variants at one block size (CI time)
        gate_up_bias = torch.empty(experts, 2 * intermediate, dtype=dtype) if bias else None
        down_bias = torch.empty(experts, hidden_size, dtype=dtype) if bias else None
        stacked = tm.ExpertWeights(torch.empty(experts, 2 * intermediate, hidden_size, dtype=dtype),
                                   torch.empty(experts, hidden_size, intermediate, dtype=dtype),
                                   gate_up_bias, down_bias)
        tm.grouped_experts(hidden, token_index, route_weights, counts, stacked, lambda gate, up: gate * up)
    if dtype != torch.float32:  # int8 experts: 16-bit activations, as the format's scales
        int8 = tm.ExpertWeights(torch.empty(experts, 2 * intermediate, hidden_size, dtype=torch.int8),
                                torch.empty(experts, hidden_size, intermediate, dtype=torch.int8),
                                gate_up_scales=torch.empty(experts, 2 * intermediate, dtype=dtype),
                                down_scales=torch.empty(experts, hidden_size, dtype=dtype),
                                hidden_size=hidden_size, intermediate_size=intermediate)
        tm.grouped_experts(hidden, token_index, route_weights, counts, int8, lambda gate, up: gate * up, 3)
"""


@pytest.mark.skipif(not os.environ.get("PAGODA_TRITON_COMPILE"), reason="set PAGODA_TRITON_COMPILE=1")
@pytest.mark.parametrize("arch,dtype", [(90, "bfloat16"), (80, "float16"), (80, "float32")])
def test_kernel_compiles_for_gpu(arch, dtype):
    result = compile_for_gpu(COMPILE_FOR_GPU, arch, dtype)
    assert result.returncode == 0, result.stderr[-4000:]
