"""The native bf16 and int4 products against dequantize-then-matmul in torch, on every
instruction-set path, and GGUF/int4/bf16 models generating the same with the kernels on (the GGUF
block products themselves: test_native_gguf_blocks.py).

Tolerances: float32 sums in another order than MKL's: |native - torch| <= 1e-5 * sqrt(K) * (1 + |torch|).
A bfloat16 x gives a bfloat16 output: one bfloat16 rounding of the float32 result (rtol 1/128).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagoda import native
from pagoda.quant.weight_formats import dequantize_int4_grouped, pack_int4_nibbles, quantize_int4_grouped

if not native.available():
    pytest.skip(f"the native kernels do not build here: {native._build()}", allow_module_level=True)

KERNELS = native.resolve_native_kernels("on", torch.device("cpu"))
ROWS = (1, 3, 16, 17)
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys"]


def _close(actual: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * k**0.5)


def check_bf16(m: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(m)
    k, n = 100, 37  # K not a multiple of any vector width
    x, weight = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator).bfloat16()
    b = torch.randn(n, generator=generator) if bias else None
    expected = F.linear(x, weight.float(), b)
    _close(KERNELS.linear_bf16(x, weight, b), expected, k)
    low = KERNELS.linear_bf16(x.bfloat16(), weight, b)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), F.linear(x.bfloat16().float(), weight.float(), b), rtol=1 / 128, atol=1e-2)


def check_int4(m: int, bias: bool, group: int, zero_point: bool) -> None:
    generator = torch.Generator().manual_seed(m + group)
    k, n = 256, 19
    x, weight = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    codes, scales, zeros = quantize_int4_grouped(weight, group, zero_point)
    expected = F.linear(x, dequantize_int4_grouped(codes, scales, zeros, group), b)
    out = KERNELS.linear_int4(x, pack_int4_nibbles(codes), scales, zeros if zero_point else None, b)
    _close(out, expected, k)


def check_all() -> None:
    for m in ROWS:
        for bias in (False, True):
            check_bf16(m, bias)
            for group in (32, 64, 128):
                check_int4(m, bias, group, zero_point=group != 64)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_products_match_dequantized_torch(m, bias):
    check_bf16(m, bias)
    for group, zero_point in ((32, True), (64, False), (128, True)):
        check_int4(m, bias, group, zero_point)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_narrower_instruction_sets_match_too(isa):
    if isa == "avx2" and KERNELS.isa == "scalar":
        pytest.skip("this CPU has no AVX2")
    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys; sys.path.insert(0, 'tests/native'); import test_native_quantized as t; "
        "assert t.KERNELS.isa == sys.argv[1], t.KERNELS.isa; t.check_all()"
    )
    env = {**os.environ, "PAGODA_NATIVE_ISA": isa, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", script, isa], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


# ---- models: the same greedy tokens with the kernels on as off ----------------------------------


def _greedy_ids(model: Path, **engine_args) -> list[list[int]]:
    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    llm = LLM(model=str(model), kv_cache_memory="32MiB", **engine_args)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    return [list(o.outputs[0].token_ids) for o in outputs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for left, right in zip(a, b) for x, y in zip(left, right)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def gguf_models(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("gguf")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
    from gguf_factory import write_gguf
    from model_factory import build_model

    root = tmp_path_factory.mktemp("native-gguf")
    llama = build_model(root / "llama", "llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return {"llama": llama, **{t: write_gguf(llama, root / f"tiny-{t}.gguf", t) for t in ("Q8_0", "Q4_0")}}


@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_0"])
def test_gguf_blocks_stay_quantized_and_generate_alike(gguf_models, block_type):
    from pagoda.kernels import Kernels
    from pagoda.model.loader import load_model, load_model_config
    from pagoda.quant.gguf_checkpoint import GGUFCheckpoint
    from pagoda.quant.weight_formats import FullWeight

    gguf = pytest.importorskip("gguf")
    path = gguf_models[block_type]
    model = load_model(
        path,
        load_model_config(path),
        torch.float32,
        torch.device("cpu"),
        FullWeight(native_layout=True),
        kernels=Kernels(torch.device("cpu"), KERNELS),
    )
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight_format.name == "gguf" and layer.gguf_parts == ((0, layer.out_features, block_type),)
    assert not hasattr(layer, "weight")
    tensor = GGUFCheckpoint(path).tensors["blk.0.ffn_down.weight"]
    assert torch.equal(layer.gguf_part_0, torch.from_numpy(tensor.data.copy()))  # the file's bytes, nothing else
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    # One-hot rows quantize to 8 bits exactly but for the float16 rounding of a Q8_0 block scale (2^-11).
    torch.testing.assert_close(layer(torch.eye(layer.in_features)).t(), expected, rtol=1e-3, atol=1e-6)
    on, off = _greedy_ids(path, native_kernels="on"), _greedy_ids(path)
    # Off: Q8_0 is dequantized to float32, Q4_0 runs tinygemm in bfloat16; on: 8-bit activations, as llama.cpp.
    assert _agreement(on, off) >= 0.8


@pytest.mark.parametrize(
    "engine_args",
    [{"quantization": "int4"}, {"dtype": "bfloat16"}, {"quantization": "int8"}],
    ids=["int4", "bf16", "int8"],
)
def test_models_generate_alike_with_the_kernels_on(gguf_models, engine_args):
    on = _greedy_ids(gguf_models["llama"], native_kernels="on", **engine_args)
    off = _greedy_ids(gguf_models["llama"], **engine_args)
    # int4/int8 off compute in bfloat16 (tinygemm, _weight_int8pack_mm), on in float32: near-ties may flip.
    assert _agreement(on, off) >= 0.8


def test_bfloat16_model_follows_transformers_with_the_kernels_on(tmp_path):
    from model_factory import build_model, hf_greedy, load_hf_model
    from pagoda.engine.llm import LLM
    from pagoda.sampling_params import SamplingParams

    directory = build_model(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    hf_model = load_hf_model(directory)  # float32 from the bfloat16 weights
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, hf_model.config.vocab_size, (n,), generator=generator).tolist() for n in (3, 11, 40)]
    llm = LLM(model=str(directory), dtype="bfloat16", native_kernels="on")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    expected = [hf_greedy(hf_model, prompt, 24)[0] for prompt in prompts]
    # bfloat16 activations against float32 ones: observed 66/72, the same as with the kernels off.
    assert _agreement([o.outputs[0].token_ids for o in outputs], expected) >= 0.85
