"""The batch's token bitmask: bit t of row r (word t // 32, bit t % 32) allows token t."""

from __future__ import annotations

import torch


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed (-1 is every bit set); int32 on the CPU, where matchers write it."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set disallowed logits to -inf in place, for `rows` of `logits` (all rows if None), in
    one vectorised operation. `bitmask` has one row per selected logits row. Rows not selected
    are not touched at all, so unconstrained requests see bit-identical logits."""
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:  # tokens past the mask's width are not in the tokenizer
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
