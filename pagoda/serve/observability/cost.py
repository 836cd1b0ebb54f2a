"""--price-table FILE: what a request costs, in USD, from its token counts.

The table (YAML or JSON) prices each served model per 1K tokens; cached prompt tokens (those
the prefix cache served) may be priced apart, and cost the prompt price when not::

    models:
      my-model:
        prompt: 0.50          # USD per 1K prompt tokens computed
        cached_prompt: 0.05   # USD per 1K prompt tokens found in the prefix cache
        completion: 1.50      # USD per 1K generated tokens

A table that names a model the server does not serve, a field it does not know or a price that
is negative or not a number is refused at startup, naming the field. Without a table requests
carry token counts only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.data_files import DataFileError, read_data_file

PER_TOKENS = 1000
_PRICE_FIELDS = ("prompt", "cached_prompt", "completion")


class PriceTableError(ValueError):
    """The price table is malformed; the message names the field."""


@dataclass(frozen=True)
class ModelPrice:
    """USD per 1K tokens of one model."""

    prompt: float
    completion: float
    cached_prompt: float | None = None  # None: cached prompt tokens cost the prompt price

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """USD for one request; `cached_tokens` are part of `prompt_tokens`."""
        cached = min(max(cached_tokens, 0), prompt_tokens)
        cached_price = self.prompt if self.cached_prompt is None else self.cached_prompt
        return (
            (prompt_tokens - cached) * self.prompt + cached * cached_price + completion_tokens * self.completion
        ) / PER_TOKENS


@dataclass(frozen=True)
class PriceTable:
    prices: dict[str, ModelPrice]

    def price_of(self, model: str) -> ModelPrice | None:
        return self.prices.get(model)

    def cost(self, model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float | None:
        """USD for one request of `model`, or None when the table does not price it."""
        price = self.prices.get(model)
        return None if price is None else price.cost(prompt_tokens, completion_tokens, cached_tokens)


def _price(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PriceTableError(f"{where} must be a number (USD per 1K tokens), got {value!r}")
    if value < 0:
        raise PriceTableError(f"{where} must not be negative, got {value!r}")
    return float(value)


def parse_price_table(data: Any, served_models: Iterable[str]) -> PriceTable:
    """The table from its parsed YAML/JSON; PriceTableError names what is wrong."""
    if not isinstance(data, dict):
        raise PriceTableError("the table must be a mapping with 'models'")
    unknown = sorted(map(str, set(data) - {"models"}))
    if unknown:
        raise PriceTableError(f"{unknown[0]}: unknown field (the table holds only 'models')")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise PriceTableError("models must map each served model name to its prices")
    served = set(served_models)
    prices = {}
    for name, entry in models.items():
        where = f"models.{name}"
        if name not in served:
            raise PriceTableError(f"{where}: unknown model {name!r} (served: {', '.join(sorted(served))})")
        if not isinstance(entry, dict):
            raise PriceTableError(f"{where} must be a mapping of {', '.join(_PRICE_FIELDS)}")
        for field_name in entry:
            if field_name not in _PRICE_FIELDS:
                raise PriceTableError(f"{where}.{field_name}: unknown field (known: {', '.join(_PRICE_FIELDS)})")
        for required in ("prompt", "completion"):
            if required not in entry:
                raise PriceTableError(f"{where}.{required} is missing")
        prices[name] = ModelPrice(
            prompt=_price(f"{where}.prompt", entry["prompt"]),
            completion=_price(f"{where}.completion", entry["completion"]),
            cached_prompt=_price(f"{where}.cached_prompt", entry["cached_prompt"])
            if "cached_prompt" in entry
            else None,
        )
    return PriceTable(prices)


def load_price_table(path: str | Path, served_models: Iterable[str]) -> PriceTable:
    """Read and check a price table file; PriceTableError names the file's problem."""
    try:
        data = read_data_file(path)
    except DataFileError as exc:
        raise PriceTableError(str(exc)) from None
    return parse_price_table(data, served_models)
