"""What a /metrics scrape may name: no tenant-scoped names in label values.

With --api-keys, tenants must not learn of each other through /metrics (which is open by default,
as in vLLM, or guarded by one --metrics-token for scrapers): a tenant id or a LoRA adapter's name
in a label value would tell any scraper what another tenant's /v1/models hides. Unless
--metrics-tenant-labels is set, such label values are emptied in what /metrics renders, and the
series that then share every label are merged (counts summed, the earliest `_created` kept), so a
counter still totals every tenant. The dashboard reads the registry itself and applies its own
per-tenant view.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.registry import Collector, CollectorRegistry

# Labels whose values name a tenant or something a tenant owns.
TENANT_SCOPED_LABELS = frozenset(
    {"tenant", "running_lora_adapters", "waiting_lora_adapters", "lora_name", "lora_adapter"}
)


class TenantLabelsRemoved(Collector):
    """The families of `source` with every tenant-scoped label value emptied."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        for family in self._source.collect():
            if not any(TENANT_SCOPED_LABELS & sample.labels.keys() for sample in family.samples):
                yield family
                continue
            merged: dict[tuple, Any] = {}
            for sample in family.samples:
                labels = {k: "" if k in TENANT_SCOPED_LABELS else v for k, v in sample.labels.items()}
                key = (sample.name, tuple(sorted(labels.items())))
                into = merged.get(key)
                if into is None:
                    merged[key] = sample._replace(labels=labels)
                elif sample.name.endswith("_created"):
                    merged[key] = into._replace(value=min(into.value, sample.value))
                elif family.type in ("counter", "histogram", "summary"):
                    merged[key] = into._replace(value=into.value + sample.value)
                else:  # a gauge: the latest (e.g. lora_requests_info's snapshot time)
                    merged[key] = into._replace(value=max(into.value, sample.value))
            copy = type(family).__new__(type(family))
            copy.__dict__.update(family.__dict__)
            copy.samples = list(merged.values())
            yield copy


def public_registry(source: CollectorRegistry, tenant_labels: bool) -> CollectorRegistry:
    """What /metrics renders of `source`: as it is with `tenant_labels`, else without tenant names."""
    if tenant_labels:
        return source
    public = CollectorRegistry(auto_describe=False)
    public.register(TenantLabelsRemoved(source))
    return public
