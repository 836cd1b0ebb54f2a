"""How evenly a MoE model's router spreads tokens over its experts (--moe-metrics).

`ExpertLoadMeter` switches token counting on in every `SparseMoE` block, takes the counts after
each engine step and keeps the cumulative tokens per (layer, expert) plus the last step's
imbalance: max / mean tokens per expert, and with expert parallelism per rank (the slowest rank
sets the step's pace). Rank 0 routes every token like the other ranks, so its counts are the
whole model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.model.decoder import DecoderModel
from pagoda.model.moe import SparseMoE


@dataclass
class MoEStats:
    layers: list[int]  # decoder layer index of each MoE block
    expert_tokens: list[list[int]]  # per block: tokens routed to each expert since start
    expert_imbalance: list[float]  # per block: the last step's max / mean tokens per expert
    rank_imbalance: list[float] | None  # per block: the same per expert-parallel rank; None without EP


class ExpertLoadMeter:
    def __init__(self, model: DecoderModel, expert_parallel_ranks: int | None) -> None:
        """expert_parallel_ranks: the ranks experts are placed on (None: no expert parallelism)."""
        # getattr: a pipeline stage's placeholders for other stages' layers have no MLP.
        self.blocks = [
            (index, mlp)
            for index, layer in enumerate(model.model.layers)
            if isinstance(mlp := getattr(layer, "mlp", None), SparseMoE)
        ]
        for _, block in self.blocks:
            block.count_experts(True)
        self.ranks = expert_parallel_ranks
        self.totals = [[0] * block.experts.num_experts for _, block in self.blocks]
        self.expert_imbalance = [1.0] * len(self.blocks)
        self.rank_imbalance = [1.0] * len(self.blocks)

    def after_step(self) -> None:
        for i, (_, block) in enumerate(self.blocks):
            counts = block.take_expert_counts()
            if not any(counts):
                continue
            self.totals[i] = [total + count for total, count in zip(self.totals[i], counts)]
            self.expert_imbalance[i] = imbalance(counts)
            if self.ranks is not None:
                per_rank = len(counts) // self.ranks
                self.rank_imbalance[i] = imbalance(
                    [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(self.ranks)]
                )

    def stats(self) -> MoEStats:
        return MoEStats(
            [index for index, _ in self.blocks],
            [list(t) for t in self.totals],
            list(self.expert_imbalance),
            list(self.rank_imbalance) if self.ranks is not None else None,
        )


def imbalance(counts: list[int]) -> float:
    """max / mean: 1.0 when perfectly even, the number of groups when one takes everything."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0
