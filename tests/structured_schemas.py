"""Seeded random JSON schemas for structured-output tests: nested objects, arrays, enums,
required fields and bounded numbers, each bounded so that even a random model finishes."""

from __future__ import annotations

import random
from typing import Any


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "y z", "42"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "kind", "size", "tags", "owner", "meta", "value"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_object_schema(rng: random.Random) -> dict[str, Any]:
    while True:
        schema = random_schema(rng)
        if schema.get("type") == "object":
            return schema
