"""Prometheus families for LoRA adapters, read from the engine's stats snapshot.

`lora_requests_info` follows vLLM's `vllm:lora_requests_info`: a gauge whose labels carry the
adapters of the running and of the waiting requests (comma-separated names) and `max_lora`,
and whose value is the time of the snapshot; dashboards take the latest series. Nothing is
exported without --enable-lora.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pagoda.engine.engine_core import LoRAStats


def lora_families(stats: LoRAStats | None, prefix: str, labels: list[str], values: list[str]) -> Iterator[Any]:
    if stats is None:
        return
    info = GaugeMetricFamily(
        prefix + "lora_requests_info",
        "Adapters of the running and waiting requests.",
        labels=labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    info.add_metric(
        values + [str(stats.max_loras), ",".join(stats.running_adapters), ",".join(stats.waiting_adapters)], time.time()
    )
    yield info
    loaded = GaugeMetricFamily(prefix + "lora_loaded_adapters", "LoRA adapters loaded (servable).", labels=labels)
    loaded.add_metric(values, len(stats.loaded_adapters))
    yield loaded
    loads = CounterMetricFamily(
        prefix + "lora_slot_loads",
        "Adapters copied into a compute slot (first use or after an LRU eviction).",
        labels=labels,
    )
    loads.add_metric(values, stats.num_slot_loads)
    yield loads
