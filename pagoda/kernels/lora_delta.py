"""The batched LoRA delta: `y[t] += x[t] @ A[slot[t]]^T @ B[slot[t]]^T` for every token of a
step that uses an adapter, in one call, whatever mix of adapters the step holds (Punica's
SGMV, S-LoRA). Rows of base-model tokens are never written, so their output is bit-identical
to the base layer's.

Stacked weights per layer: `lora_a` [slots, width, in] and `lora_b_t` [slots, width, out]
(B transposed, so each slot's expand operand is contiguous). Only the first `width` rows are
read, the step's largest rank (times the fused parts): smaller adapters are zero-padded.

Formulations on CPU (benchmarks/lora_ops.py, results in benchmarks/results/lora/lora_ops.json):
- segmented (used): tokens sorted by slot, two GEMMs per adapter present in the step; each
  adapter's weights are read once. Fastest wherever several adapters share a step, decode and
  prefill, small ranks and large: ahead of the dense one, far ahead of the gathered one.
- gathered: each token's A and B gathered and multiplied with one bmm (Punica's BGMV); it
  copies `width * (in + out)` weights per token. Kept as the independent reference the tests
  check the segmented path and the GPU kernels against.
- dense (only in the benchmark): every token times every slot's A, masked to its own slot,
  then one GEMM over all slots' B; its cost grows with slots x rank.
On CUDA the Triton kernels in kernels/triton/lora_delta.py take over.
"""

from __future__ import annotations

import torch

from pagoda.kernels.lora_batch import LoRABatch


def add_lora_delta(
    output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch, width: int
) -> torch.Tensor:
    """Add the delta of each adapter token to `output` [T, out] in place; returns `output`.
    On CUDA the Triton kernels (kernels/triton/lora_delta.py) do it in two launches instead."""
    if batch.covers_all_tokens and len(batch.segments) == 1:
        slot = batch.segments[0][0]  # one adapter for the whole batch: no gather, no scatter
        output += (x @ lora_a[slot, :width].T) @ lora_b_t[slot, :width]
        return output
    delta = segmented_delta(x.index_select(0, batch.rows), lora_a, lora_b_t, batch, width)
    return output.index_add_(0, batch.rows, delta)


def segmented_delta(
    x_rows: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch, width: int
) -> torch.Tensor:
    """Deltas of the adapter rows (ordered as `batch.rows`): two GEMMs per adapter segment."""
    delta = x_rows.new_empty(x_rows.shape[0], lora_b_t.shape[-1])
    for slot, start, end in batch.segments:
        torch.mm(x_rows[start:end] @ lora_a[slot, :width].T, lora_b_t[slot, :width], out=delta[start:end])
    return delta


def gathered_delta(
    x_rows: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch, width: int
) -> torch.Tensor:
    """Deltas of the adapter rows with per-token gathered weights and one bmm per side."""
    shrunk = torch.bmm(lora_a[batch.slots, :width], x_rows.unsqueeze(-1))  # [n, width, 1]
    return torch.bmm(shrunk.transpose(1, 2), lora_b_t[batch.slots, :width]).squeeze(1)
