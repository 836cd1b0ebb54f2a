"""`pagoda:cost_usd_total{model,tenant}`: what the requests cost by the --price-table, in USD.

Registered only with a price table (without one there is no price to count). `tenant` is a
tenant-scoped label: /metrics empties it unless --metrics-tenant-labels (label_policy.py),
while the dashboard reads the registry itself and shows each tenant its own cost.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

COST_METRIC = "pagoda:cost_usd"


class CostCounter:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter(
            COST_METRIC,
            "Cost of the requests served, in USD, by the price table.",
            ["model", "tenant"],
            registry=registry,
        )

    def add(self, model: str, tenant: str | None, usd: float) -> None:
        self._counter.labels(model, tenant or "").inc(usd)
