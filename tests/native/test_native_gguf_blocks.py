"""The native GGUF block products (pagoda/csrc/gguf_blocks.cpp) against gguf-py's dequantization of the
same bytes, on every instruction-set path, and a tiny model written as GGUF with mixed tensor types
served from its bytes.

Tolerances. Rows dequantized for an embedding lookup: gguf-py's values within float32 rounding (the
same formulas). Products: the activation is quantized to 8 bits per block as llama.cpp does (blocks
of 32 with a float16 scale d = max|x| / 127 for the legacy types, of 256 with d = max|x| / 127 for
K-quants and IQ4_XS), so against the float product x @ W^T each input is off by at most d / 2 (plus,
for a float16 scale, 127 * d * 2^-11): |out - x @ W^T| <= sum_k |W_ik| * 0.57 * d_k. Against
W times the activation as quantized (`_quantized_activation`, the reference of that rounding) the
product agrees to float32 rounding of another summation order: 1e-5 * sqrt(K) * (1 + |expected|).
The SIMD paths against the scalar path: the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import native
from pagoda.quant.weight_formats import GGUF_BLOCK_TYPES, GGUFBlocks

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)
gguf = pytest.importorskip("gguf")

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
# Offsets of each type's float16 scales in its block (random bytes there could be inf/NaN).
SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}
PATHS = ("", "avx2", "scalar")


def random_blocks(type_name: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """Valid `type_name` rows [rows, bytes]: random codes and sub-block scales, small float16 scales."""
    _, values, size = GGUF_BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        scales = (rng.uniform(0.5, 1.5, (rows, k // values)) * 0.01).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, k // values, 2)
    return torch.from_numpy(blocks.reshape(rows, -1))


def _dequantized(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).astype(np.float32))


def _quantized_activation(x: torch.Tensor, k_blocks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's activation rounding in torch: (x as quantized and dequantized, each input's block scale)."""
    m, k = x.shape
    size = 256 if k_blocks else 32
    blocks = x.reshape(m, k // size, size)
    if k_blocks:  # quantize_row_q8_K_ref: the signed value of largest magnitude maps to -127
        signed_max = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        iscale = torch.where(signed_max == 0, torch.zeros_like(signed_max), -127.0 / signed_max)
        codes = torch.round(blocks * iscale).clamp(max=127)
        scale = torch.where(iscale == 0, torch.zeros_like(iscale), 1.0 / iscale)
    else:  # quantize_row_q8_0_ref: scale max|x| / 127 stored as float16
        exact = blocks.abs().amax(-1, keepdim=True) / 127.0
        inverse = torch.where(exact == 0, torch.zeros_like(exact), 1.0 / exact)
        codes = torch.sign(blocks * inverse) * torch.floor((blocks * inverse).abs() + 0.5)
        scale = exact.half().float()
    values = (codes * scale).reshape(m, k)
    return values, scale.abs().expand(-1, -1, size).reshape(m, k)


@pytest.mark.parametrize("type_name", list(GGUF_BLOCK_TYPES))
def test_rows_dequantize_as_gguf_py(type_name):
    k = 512 if GGUF_BLOCK_TYPES[type_name][1] == 256 else 96
    blocks = random_blocks(type_name, 7, k, seed=1)
    ids = torch.tensor([6, 0, 3, 3])
    rows = KERNELS.gguf_dequantize_rows(blocks, GGUF_BLOCK_TYPES[type_name][0], ids)
    torch.testing.assert_close(rows, _dequantized(type_name, blocks)[ids], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("type_name", list(GGUF_BLOCK_TYPES))
@pytest.mark.parametrize("m", [1, 3, 9])
def test_products_match_dequantized_torch_on_every_path(type_name, m):
    type_id, values, _ = GGUF_BLOCK_TYPES[type_name]
    k_blocks = values == 256
    k, n = (768, 11) if k_blocks else (96, 13)  # K an odd number of 32-blocks: the half-vector tail
    blocks = random_blocks(type_name, n, k, seed=m)
    weight = _dequantized(type_name, blocks)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    activation = KERNELS.gguf_quantize_activation(x, k_blocks)
    x_quantized, x_scale = _quantized_activation(x, k_blocks)
    expected = x_quantized @ weight.T
    outs = {path: KERNELS.gguf_linear(activation, blocks, type_id, None, path) for path in PATHS}
    tolerance = 1e-5 * k**0.5
    for path, out in outs.items():
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance, msg=f"path {path!r}")
        torch.testing.assert_close(out, outs["scalar"], rtol=tolerance, atol=tolerance, msg=f"{path!r} vs scalar")
    bound = (weight.abs()[None] * x_scale[:, None, :] * 0.57).sum(-1) + 1e-5
    assert ((outs[""] - x @ weight.T).abs() <= bound).all()


def test_a_bias_and_a_fused_layer_of_mixed_types():
    from pagoda.kernels import Kernels
    from pagoda.model.layers import Linear
    from pagoda.quant.weight_formats import GGUFBlockWeight

    k = 256
    parts = [("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4)]  # q, k in Q4_K and v in Q6_K, as a Q4_K_M file has them
    layer = Linear(k, 16, True, torch.float32, torch.device("cpu"), GGUFBlockWeight(), kernels=_kernels(Kernels))
    offset, pieces = 0, []
    for index, (type_name, rows) in enumerate(parts):
        blocks = random_blocks(type_name, rows, k, seed=10 + index)
        layer.weight_format.stage_blocks(layer, offset, GGUFBlocks(type_name, blocks))
        pieces.append(_dequantized(type_name, blocks))
        offset += rows
    layer.bias.data.copy_(torch.arange(16.0))
    layer.finalize("qkv_proj")
    assert layer.gguf_parts == ((0, 12, "Q4_K"), (12, 4, "Q6_K"))  # same-type neighbours concatenated
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(0))
    x_quantized, _ = _quantized_activation(x.reshape(-1, k), True)
    expected = (x_quantized @ torch.cat(pieces).T + torch.arange(16.0)).reshape(2, 3, 16)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def _kernels(kernels_class):
    return kernels_class(torch.device("cpu"), KERNELS)


def test_rejects_malformed_blocks():
    activation = KERNELS.gguf_quantize_activation(torch.randn(1, 32), False)
    with pytest.raises(RuntimeError, match="whole blocks"):
        KERNELS.gguf_linear(activation, torch.zeros(2, 35, dtype=torch.uint8), 8, None)
    with pytest.raises(RuntimeError, match="activation codes"):
        KERNELS.gguf_linear(activation, torch.zeros(2, 36, dtype=torch.uint8), 2, None)
    with pytest.raises(RuntimeError, match="not a multiple of 256"):
        KERNELS.gguf_quantize_activation(torch.randn(1, 288), True)


# ---- a tiny model written as GGUF with mixed types --------------------------------------------------------------

MIXED = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "ffn_up": "Q5_K"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
    from gguf_factory import write_gguf
    from model_factory import build_model

    root = tmp_path_factory.mktemp("mixed-gguf")
    llama = build_model(
        root / "llama",
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return write_gguf(llama, root / "mixed.gguf", "Q4_1", k_quants=MIXED, k_quant_scale=2e-5)


def test_a_mixed_type_file_is_served_from_its_bytes(mixed_gguf):
    from pagoda.kernels import Kernels
    from pagoda.model.loader import load_model, load_model_config
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint
    from pagoda.quant.weight_formats import FullWeight

    config = load_model_config(mixed_gguf)
    model = load_model(
        mixed_gguf,
        config,
        torch.float32,
        torch.device("cpu"),
        FullWeight(native_layout=True),
        kernels=_kernels(Kernels),
    )
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    assert attention.qkv_proj.gguf_parts == ((0, q + kv, "Q4_K"), (q + kv, kv, "Q6_K"))
    assert mlp.gate_up_proj.gguf_parts == (
        (0, config.intermediate_size, "Q4_1"),
        (config.intermediate_size, config.intermediate_size, "Q5_K"),
    )
    assert model.model.embed_tokens.gguf_type == "Q4_1"
    # Memory holds the file's tensor bytes (norms in float32 as stored), nothing expanded.
    held = sum(b.numel() * b.element_size() for b in model.buffers() if b.device.type == "cpu")
    held += sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cpu")
    stored = sum(int(t.n_bytes) for t in GGUFCheckpoint(mixed_gguf).reader.tensors)
    rotary = sum(b.numel() * b.element_size() for r in model.rotaries for b in r.buffers())
    assert held - rotary <= stored * 1.01
    # The same file dequantized to float32 (the kernels off) generates nearly the same greedy tokens.
    on, off = _greedy_ids(mixed_gguf, native_kernels="on"), _greedy_ids(mixed_gguf)
    pairs = [(a, b) for left, right in zip(on, off) for a, b in zip(left, right)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.8


def _greedy_ids(model: Path, **engine_args) -> list[list[int]]:
    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    llm = LLM(model=str(model), kv_cache_memory="32MiB", **engine_args)
    prompts = [[5, 17, 42, 7], [99, 3, 250, 11, 64, 8, 31], [2, 300]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_a_type_without_a_native_product_is_dequantized_and_named_once(mixed_gguf, tmp_path, caplog):
    from pagoda.kernels import Kernels
    from pagoda.model.loader import load_model, load_model_config
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint
    from pagoda.quant.weight_formats import FullWeight

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
    from gguf_factory import write_gguf

    path = write_gguf(
        mixed_gguf.parent / "llama", tmp_path / "iq2.gguf", "F16", k_quants={"ffn_down": "IQ2_XXS"}, k_quant_scale=2e-5
    )
    with caplog.at_level("INFO", logger="pagoda.quant.gguf_checkpoint"):
        model = load_model(
            path,
            load_model_config(path),
            torch.float32,
            torch.device("cpu"),
            FullWeight(native_layout=True),
            kernels=_kernels(Kernels),
        )
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "blk.0.ffn_down.weight (IQ2_XXS)" in lines[0] and "2 IQ2_XXS" in lines[0]
    down, qkv = model.model.layers[0].mlp.down_proj, model.model.layers[0].self_attn.qkv_proj
    assert down.gguf_parts == ((0, down.out_features, "F32"),) and qkv.gguf_parts[0][2] == "F32"  # F16 rows as floats
    assert model.model.embed_tokens.gguf_type is None  # an F16 embedding stays a float weight
    tensor = GGUFCheckpoint(path).tensors["blk.0.ffn_down.weight"]
    weight = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    x = torch.randn(3, down.in_features)
    torch.testing.assert_close(down(x), x @ weight.T, rtol=1e-5, atol=1e-5)
