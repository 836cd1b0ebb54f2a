"""The Triton LoRA kernels (pagoda/kernels/triton/lora_delta.py) against the torch formulation.

With a GPU they run compiled; without one under Triton's interpreter (TRITON_INTERPRET=1),
which runs each program in numpy, so shapes are small. Tiles, widths and feature counts are
chosen off the kernels' block sizes on purpose (partial tiles, masks on every axis)."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.kernels.lora_delta import segmented_delta
from pagoda.lora.batch import NO_SLOT, build_lora_batch
from triton_compile import compile_for_gpu
from triton_import import import_triton_module

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"


triton_delta = import_triton_module("pagoda.kernels.triton.lora_delta", interpret=INTERPRET)


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernels_match_the_segmented_delta_and_leave_base_rows_alone(dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    num_slots, max_width, in_features, out_features = 3, 40, 48, 80
    lora_a = (torch.randn(num_slots, max_width, in_features, generator=generator) * 0.2).to(dtype)
    lora_b_t = (torch.randn(num_slots, max_width, out_features, generator=generator) * 0.2).to(dtype)
    # A 20-token prefill chunk (two tiles), decodes, base tokens between them.
    runs = [(2, 20), (NO_SLOT, 3), (0, 1), (1, 1), (NO_SLOT, 1), (0, 5), (1, 1)]
    batch = build_lora_batch(runs, {0: 8, 1: 3, 2: 8}, DEVICE)
    width = 24  # rank 8 x 3 fused parts
    x = torch.randn(batch.num_tokens, in_features, generator=generator).to(dtype)
    base = torch.randn(batch.num_tokens, out_features, generator=generator).to(dtype)
    x, base, lora_a, lora_b_t = (t.to(DEVICE) for t in (x, base, lora_a, lora_b_t))

    output = triton_delta.add_lora_delta_triton(base.clone(), x, lora_a, lora_b_t, batch, width)

    reference = base.float().clone()
    rows = batch.rows
    reference[rows] += segmented_delta(x.float().index_select(0, rows), lora_a.float(), lora_b_t.float(), batch, width)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(output.float(), reference, **tolerance)
    base_rows = [i for i in range(batch.num_tokens) if i not in set(rows.tolist())]
    assert torch.equal(output[base_rows], base[base_rows])
    # Slot 0's six tokens, slot 1's two, slot 2's twenty in two tiles of at most BLOCK_M = 16.
    assert triton_delta.tile_table(batch).tolist() == [[0, 0, 6], [1, 6, 8], [2, 8, 24], [2, 24, 28]]


# The interpreter checks what the kernels compute, not that they compile: this lowers both
# kernels, as the launcher calls them, to GPU binaries (Triton's bundled ptxas; no GPU needed).
COMPILE_FOR_GPU = r"""
import torch
from triton_compile import arch_and_dtype, compiling
from pagoda.kernels.triton import lora_delta as td
from pagoda.lora.batch import build_lora_batch

dtype = arch_and_dtype()[1]

td._shrink_kernel = compiling(td._shrink_kernel)
td._expand_kernel = compiling(td._expand_kernel)
batch = build_lora_batch([(0, 20), (-1, 2), (1, 3)], {0: 8, 1: 16}, torch.device("cpu"))
for in_features, out_features, width in ((4096, 12288, 48), (4096, 4096, 128), (11008, 4096, 16)):
    x = torch.empty(batch.num_tokens, in_features, dtype=dtype)
    td.add_lora_delta_triton(torch.empty(batch.num_tokens, out_features, dtype=dtype), x,
                             torch.empty(2, width, in_features, dtype=dtype),
                             torch.empty(2, width, out_features, dtype=dtype), batch, width)
"""


@pytest.mark.skipif(not os.environ.get("PAGODA_TRITON_COMPILE"), reason="set PAGODA_TRITON_COMPILE=1 (about a minute)")
@pytest.mark.parametrize("arch,dtype", [(90, "bfloat16"), (80, "float32")])
def test_kernels_compile_for_gpu(arch, dtype):
    result = compile_for_gpu(COMPILE_FOR_GPU, arch, dtype)
    assert result.returncode == 0, result.stderr[-4000:]
