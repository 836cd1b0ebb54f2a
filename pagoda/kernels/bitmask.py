"""The batch's token bitmask: bit t of row r (word t // 32, bit t % 32) allows token t, and the op
that applies it to the logits (structured output's grammar masks, pagoda.structured.manager)."""

from __future__ import annotations

import numpy as np
import torch


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed (-1 is every bit set); int32 on the CPU, where matchers write it."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Set disallowed logits to -inf in place, for `rows` of `logits` (all rows if None), in
    one vectorised pass: `minimum(logits, bound)` with bound +inf where allowed and -inf where
    not. Rows not selected are not touched at all, so unconstrained requests see bit-identical
    logits. `bitmask` has one row per selected logits row."""
    vocab = logits.shape[-1]
    bits = _unpack(bitmask, logits.device)
    if bits.shape[1] < vocab:  # tokens past the mask's width are not in the tokenizer
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=0)
    bound = bits[:, :vocab].to(logits.dtype).mul_(2.0).sub_(1.0).mul_(float("inf"))
    if rows is None:
        torch.minimum(logits, bound, out=logits)
    else:
        logits[rows] = torch.minimum(logits[rows], bound)


def _unpack(bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[rows, words] int32 -> [rows, 32 * words] uint8 0/1, on `device`. On the CPU numpy's
    unpackbits is several times faster than shifting in torch (benchmarks/structured_output.py)."""
    if device.type == "cpu":
        packed = bitmask.contiguous().numpy().view(np.uint8)  # little-endian words: bit t is byte t//8, bit t%8
        return torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little"))
    bitmask = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).to(torch.uint8).flatten(1)
