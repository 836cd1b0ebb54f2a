"""The Triton LoRA kernels (pagoda/lora/triton_delta.py) against the torch formulation.

With a GPU they run compiled; without one under Triton's interpreter (TRITON_INTERPRET=1),
which runs each program in numpy, so shapes are small. Tiles, widths and feature counts are
chosen off the kernels' block sizes on purpose (partial tiles, masks on every axis)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from pagoda.lora.batch import NO_SLOT, build_lora_batch
from pagoda.lora.delta import segmented_delta

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"


def _import_kernels():
    """TRITON_INTERPRET is read when @triton.jit decorates: set it before triton's first import."""
    if not INTERPRET:
        pytest.importorskip("triton")
        from pagoda.lora import triton_delta
        return triton_delta
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process", allow_module_level=True)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        from pagoda.lora import triton_delta
        return triton_delta
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


triton_delta = _import_kernels()


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
    reference[rows] += segmented_delta(x.float().index_select(0, rows), lora_a.float(), lora_b_t.float(), batch,
                                       width)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(output.float(), reference, **tolerance)
    base_rows = [i for i in range(batch.num_tokens) if i not in set(rows.tolist())]
    assert torch.equal(output[base_rows], base[base_rows])
    # Slot 0's six tokens, slot 1's two, slot 2's twenty in two tiles of at most BLOCK_M = 16.
    assert triton_delta.tile_table(batch).tolist() == [[0, 0, 6], [1, 6, 8], [2, 8, 24], [2, 24, 28]]
