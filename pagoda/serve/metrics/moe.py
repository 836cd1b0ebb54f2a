"""Prometheus families for mixture-of-experts load balance, read from the engine's stats
snapshot; nothing is exported without --moe-metrics (on a MoE model).

`moe_expert_tokens_total{layer,expert}` counts the tokens routed to each expert of each MoE
layer (a token counts once for each of its top-k experts); `moe_expert_imbalance{layer}` is the
last step's max / mean tokens per expert, and with expert parallelism `moe_rank_imbalance{layer}`
the same per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pagoda.model.moe_load import MoEStats


def moe_families(stats: MoEStats | None, prefix: str, labels: list[str], values: list[str]) -> Iterator[Any]:
    if stats is None:
        return
    tokens = CounterMetricFamily(
        prefix + "moe_expert_tokens",
        "Tokens routed to each expert of each MoE layer.",
        labels=labels + ["layer", "expert"],
    )
    for layer, counts in zip(stats.layers, stats.expert_tokens):
        for expert, count in enumerate(counts):
            tokens.add_metric(values + [str(layer), str(expert)], count)
    yield tokens
    gauges = [
        ("moe_expert_imbalance", "Last step's max / mean tokens per expert, per MoE layer.", stats.expert_imbalance)
    ]
    if stats.rank_imbalance is not None:
        gauges.append(
            (
                "moe_rank_imbalance",
                "Last step's max / mean tokens per expert-parallel rank, per MoE layer.",
                stats.rank_imbalance,
            )
        )
    for name, doc, per_layer in gauges:
        family = GaugeMetricFamily(prefix + name, doc, labels=labels + ["layer"])
        for layer, value in zip(stats.layers, per_layer):
            family.add_metric(values + [str(layer)], value)
        yield family
