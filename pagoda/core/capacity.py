"""How many sequences a KV pool holds: the one formula `pagoda plan` and the engine's
--max-num-seqs default both use. A running sequence holds every block its tokens touch."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens (a partly filled block is a whole block)."""
    return -(-num_tokens // block_size)


def sequences_that_fit(num_blocks: int, block_size: int, tokens_per_sequence: int) -> int:
    """Sequences of `tokens_per_sequence` tokens that a pool of `num_blocks` holds at once
    (every sequence holds at least one block, however short)."""
    return num_blocks // max(blocks_for(tokens_per_sequence, block_size), 1)
