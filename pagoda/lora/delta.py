"""The batched LoRA delta: `y[t] += x[t] @ A[slot[t]]^T @ B[slot[t]]^T` for every token of a
step that uses an adapter, in one call, whatever mix of adapters the step holds (Punica's
SGMV, S-LoRA). Rows of base-model tokens are never written, so their output is bit-identical
to the base layer's.

Stacked weights per layer: `lora_a` [slots, width, in] and `lora_b_t` [slots, width, out]
(B transposed, so each slot's expand operand is contiguous). Only the first `width` rows are
read, the step's largest rank (times the fused parts): smaller adapters are zero-padded.

Two formulations (benchmarks/lora_ops.py measures them, and more, on this CPU):
- segmented: tokens sorted by slot, two matmuls per adapter present in the step. The fastest
  here for every mix measured (decode and prefill, 1 to 16 adapters, ranks 8 to 64): each
  adapter's weights are read once and the matmuls are plain GEMMs.
- gathered: each token's A and B gathered and multiplied with one bmm (Punica's BGMV). It
  copies `width * (in + out)` weights per token; slower on CPU, kept as the reference the
  GPU kernel and the tests compare against.
"""

from __future__ import annotations

import torch

from pagoda.lora.batch import LoRABatch


def add_lora_delta(output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor,
                   batch: LoRABatch, width: int) -> torch.Tensor:
    """Add the delta of each adapter token to `output` [T, out] in place; returns `output`.
    On CUDA the Triton kernels (lora/triton_delta.py) do it in two launches."""
    if output.is_cuda:
        from pagoda.lora.triton_delta import add_lora_delta_triton

        return add_lora_delta_triton(output, x, lora_a, lora_b_t, batch, width)
    if batch.covers_all_tokens and len(batch.segments) == 1:
        slot = batch.segments[0][0]  # one adapter for the whole batch: no gather, no scatter
        output += (x @ lora_a[slot, :width].T) @ lora_b_t[slot, :width]
        return output
    delta = segmented_delta(x.index_select(0, batch.rows), lora_a, lora_b_t, batch, width)
    return output.index_add_(0, batch.rows, delta)


def segmented_delta(x_rows: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch,
                    width: int) -> torch.Tensor:
    """Deltas of the adapter rows (ordered as `batch.rows`): two GEMMs per adapter segment."""
    delta = x_rows.new_empty(x_rows.shape[0], lora_b_t.shape[-1])
    for slot, start, end in batch.segments:
        torch.mm(x_rows[start:end] @ lora_a[slot, :width].T, lora_b_t[slot, :width], out=delta[start:end])
    return delta


def gathered_delta(x_rows: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch,
                   width: int) -> torch.Tensor:
    """Deltas of the adapter rows with per-token gathered weights and one bmm per side."""
    shrunk = torch.bmm(lora_a[batch.slots, :width], x_rows.unsqueeze(-1))  # [n, width, 1]
    return torch.bmm(shrunk.transpose(1, 2), lora_b_t[batch.slots, :width]).squeeze(1)
