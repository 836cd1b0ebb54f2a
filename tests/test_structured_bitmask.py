"""The bitmask applies exactly: allowed logits unchanged, the rest -inf, other rows untouched."""

from __future__ import annotations

import torch

from pagoda.structured.bitmask import allocate_bitmask, apply_bitmask


def reference(logits: torch.Tensor, allowed: list[set[int]], rows: list[int]) -> torch.Tensor:
    expected = logits.clone()
    for mask_row, row in enumerate(rows):
        for token in range(logits.shape[1]):
            if token not in allowed[mask_row]:
                expected[row, token] = float("-inf")
    return expected


def test_apply_matches_a_token_by_token_reference():
    generator = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab, generator=generator)
    logits[1, 3] = float("-inf")
    rows = [0, 1, 3]
    allowed = [set(torch.randint(0, vocab, (30,), generator=generator).tolist()) | {3, 31, 32, 99}
               for _ in rows]
    bitmask = allocate_bitmask(len(rows), vocab)
    bitmask.zero_()
    for mask_row, tokens in enumerate(allowed):
        for token in tokens:
            word = bitmask[mask_row, token // 32].item() & 0xFFFFFFFF
            word |= 1 << (token % 32)
            bitmask[mask_row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    expected = reference(logits, allowed, rows)
    got = logits.clone()
    apply_bitmask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, expected)
    assert torch.equal(got[2], logits[2]) and torch.equal(got[4], logits[4])
    everything = logits.clone()
    apply_bitmask(everything, allocate_bitmask(5, vocab))  # all allowed: nothing changes
    assert torch.equal(everything, logits)
    wider = torch.randn(2, vocab + 40, generator=generator)  # logits past the tokenizer's vocabulary
    apply_bitmask(wider, allocate_bitmask(2, vocab))
    assert torch.isinf(wider[:, 128:]).all() and torch.isfinite(wider[:, :vocab]).all()
