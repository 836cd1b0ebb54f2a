"""Prometheus families for images (vision-language models), read from the engine's stats
snapshot; nothing is exported for a text-only model.

`images_encoded_total` and `image_tokens_encoded_total` count what the encoder step ran,
`encoder_cache_hits_total` the images a step needed that the encoder cache held (a repeated
image), `encoder_seconds_total` the encoder's time; `encoder_cache_tokens` is the cache's size
now, in image tokens (`encoder_cache_capacity_tokens` its bound).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pagoda.core.encoder_cache import EncoderCacheStats


def encoder_families(
    stats: EncoderCacheStats | None, prefix: str, labels: list[str], values: list[str]
) -> Iterator[Any]:
    if stats is None:
        return
    for name, doc, value in (
        ("images_encoded", "Images run through the vision encoder.", stats.images_encoded),
        ("image_tokens_encoded", "Image placeholder tokens the vision encoder produced.", stats.image_tokens_encoded),
        ("encoder_cache_hits", "Images a step needed that the encoder cache held.", stats.hits),
        ("encoder_seconds", "Seconds spent in the vision encoder.", stats.encoder_seconds),
    ):
        family = CounterMetricFamily(prefix + name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    for name, doc, value in (
        ("encoder_cache_tokens", "Image tokens the encoder cache holds.", stats.cached_tokens),
        ("encoder_cache_capacity_tokens", "The encoder cache's bound, in image tokens.", stats.capacity_tokens),
    ):
        gauge = GaugeMetricFamily(prefix + name, doc, labels=labels)
        gauge.add_metric(values, value)
        yield gauge
