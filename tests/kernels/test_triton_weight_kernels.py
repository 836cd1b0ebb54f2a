"""The Triton w8a16 / w4a16 kernels (the int8 / int4 formats on CUDA) against float references.

With a GPU they run compiled; without one, under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is first imported, as in tests/kernels/test_triton_attention.py), in float16: the
interpreter cannot multiply bfloat16 in `tl.dot`. PAGODA_TRITON_COMPILE=1 also lowers every
kernel variant to sm_80 / sm_90 binaries (no GPU needed).
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_compile import compile_for_gpu
from triton_import import import_triton_module

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"


kernels = import_triton_module("pagoda.kernels.triton.weight_matmul", interpret=INTERPRET)

from pagoda.quant.weight_formats import (  # noqa: E402
    Int4Weight,
    Int8Weight,
    dequantize_int4_grouped,
    quantize_int4_grouped,
    quantize_int8_per_channel,
)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


DTYPES = [torch.float16] + ([] if INTERPRET else [torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 96, 80), (5, 64, 200), (37, 130, 64)])
def test_int8_matmul_matches_dequantized_reference(dtype, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(rows, in_features, generator=generator)
    qweight, scales = quantize_int8_per_channel(weight)
    # The format pads K to a multiple of 16 (the CPU kernel's tile); the kernel reads only K.
    padded = torch.nn.functional.pad(qweight, (0, -in_features % 16))
    got = kernels.int8_matmul(x.to(dtype).to(DEVICE), padded.to(DEVICE), scales.to(dtype).to(DEVICE), in_features)
    reference = x.to(dtype).float() @ (qweight.float() * scales.to(dtype).float()[:, None]).t()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float().cpu(), reference, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size,zero_point", [(32, True), (64, False), (128, True)])
@pytest.mark.parametrize("rows", [1, 20])
def test_int4_matmul_matches_dequantized_reference(dtype, group_size, zero_point, rows):
    generator = torch.Generator().manual_seed(group_size + rows)
    out_features, in_features = 80, 256
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    x = torch.randn(rows, in_features, generator=generator)
    codes, scales, zeros = quantize_int4_grouped(weight, group_size, zero_point)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
    got = kernels.int4_matmul(
        x.to(dtype).to(DEVICE), kernels.pack_int4(codes).to(DEVICE), scales_and_zeros.to(DEVICE), group_size
    )
    dequantized = dequantize_int4_grouped(
        codes, scales_and_zeros[..., 0].t().float(), scales_and_zeros[..., 1].t().float(), group_size
    )
    reference = x.to(dtype).float() @ dequantized.t()
    torch.testing.assert_close(got.float().cpu(), reference, atol=2e-2, rtol=1e-2)
    # And close to the unquantized layer (round-to-nearest int4: within a few percent).
    relative = (got.float().cpu() - x @ weight.t()).norm() / (x @ weight.t()).norm()
    assert relative < 0.15


def test_pack_int4_chunk_layout():
    codes = torch.arange(64).remainder(16).reshape(1, 64)
    packed = kernels.pack_int4(codes)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    # Byte j of chunk c: input 32c + j (low nibble), input 32c + j + 16 (high nibble).
    for chunk in range(2):
        for j in range(16):
            byte = int(packed[0, chunk * 16 + j])
            assert byte & 0xF == int(codes[0, chunk * 32 + j]) and byte >> 4 == int(codes[0, chunk * 32 + j + 16])
    with pytest.raises(ValueError, match="divisible by 32"):
        kernels.pack_int4(torch.zeros(2, 48, dtype=torch.int32))


@pytest.mark.skipif(INTERPRET, reason="the formats take the Triton path on CUDA devices only")
@pytest.mark.parametrize("fmt", [Int8Weight(), Int4Weight(group_size=64)])
def test_formats_use_triton_kernels_on_cuda(fmt):
    from pagoda.model.layers import Linear

    weight = torch.randn(128, 256) * 0.05
    layer = Linear(256, 128, False, torch.bfloat16, DEVICE, fmt)
    layer.weight.data.copy_(weight)
    layer.finalize("test")
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=DEVICE)
    relative = (layer(x).float() - x.float() @ weight.to(DEVICE).t()).norm() / (
        x.float() @ weight.to(DEVICE).t()
    ).norm()
    assert relative < 0.15


COMPILE_FOR_GPU = r"""
import torch
from triton_compile import arch_and_dtype, compiling
from pagoda.kernels.triton import weight_matmul as tk

dtype = arch_and_dtype()[1]

tk._int8_matmul_kernel = compiling(tk._int8_matmul_kernel)
tk._int4_matmul_kernel = compiling(tk._int4_matmul_kernel)
for rows in (1, 32, 300):  # the three row-block sizes
    x = torch.empty(rows, 1024, dtype=dtype)
    tk.int8_matmul(x, torch.empty(4096, 1024, dtype=torch.int8), torch.empty(4096, dtype=dtype), 1024)
    for group in (32, 64, 128):
        tk.int4_matmul(x, torch.empty(4096, 512, dtype=torch.uint8), torch.empty(1024 // group, 4096, 2, dtype=dtype),
                       group)
"""


@pytest.mark.skipif(not os.environ.get("PAGODA_TRITON_COMPILE"), reason="set PAGODA_TRITON_COMPILE=1")
@pytest.mark.parametrize("arch,dtype", [(90, "bfloat16"), (80, "float16")])
def test_kernels_compile_for_gpu(arch, dtype):
    result = compile_for_gpu(COMPILE_FOR_GPU, arch, dtype)
    assert result.returncode == 0, result.stderr[-4000:]
