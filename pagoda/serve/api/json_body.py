"""Large JSON bodies written in short steps, so the worker thread that writes them leaves the
event loop's thread its turns.

A worker thread keeps the event loop answering only while it lets go of the GIL, which CPython
does between bytecodes, never inside one C call: one `json.dumps` (C) or `model_dump` (Rust) of
a multi-megabyte answer holds it from start to end. `model_json` and `json_text` produce exactly
the text of `JSONResponse(model.model_dump())`, but as calls that each cover about `STEP_NODES`
JSON values.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

# JSON values one C or Rust call may cover: a few milliseconds at most.
STEP_NODES = 16384
SAMPLES = 3  # items of a long list or map measured to estimate the whole
# Dicts up to this many keys are records (every value measured), longer ones maps (sampled).
RECORD_KEYS = 64
STRING_CHARS_PER_NODE = 64

# Starlette's JSONResponse.render, so both paths send the same text.
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def model_json(model: BaseModel) -> str:
    """`model` as JSONResponse(model.model_dump()) writes it, in short steps."""
    return json_text(dump_in_steps(model))


def estimated_nodes(value: Any) -> int:
    """About how many JSON values `value` becomes, measuring only a few items of each list."""
    if isinstance(value, BaseModel):
        return 1 + sum(estimated_nodes(getattr(value, name)) for name in type(value).model_fields)
    if isinstance(value, dict):
        if len(value) <= RECORD_KEYS:
            return 1 + sum(estimated_nodes(v) for v in value.values())
        return 1 + len(value) * max(estimated_nodes(v) for v in itertools.islice(value.values(), SAMPLES))
    if isinstance(value, (list, tuple)):
        return 1 + len(value) * _item_nodes(value)
    if isinstance(value, str):
        return 1 + len(value) // STRING_CHARS_PER_NODE
    return 1


def _item_nodes(items: list[Any] | tuple[Any, ...]) -> int:
    if not items:
        return 0
    return max(estimated_nodes(items[i]) for i in {0, len(items) // 2, len(items) - 1})


def dump_in_steps(model: BaseModel) -> Any:
    """`model.model_dump()`, one call per small part. Fields hold models, lists or maps that
    hold models at any depth (prompt_logprobs: a list of None or maps of models), or plain JSON
    values (which model_dump returns as they are)."""
    if estimated_nodes(model) <= STEP_NODES:
        return model.model_dump()
    return {name: _dump_field(getattr(model, name)) for name in type(model).model_fields}


def _dump_field(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return dump_in_steps(value)
    if isinstance(value, list) and value:
        if isinstance(value[0], (int, float, str, bool)):  # plain values: nothing to dump
            return value
        if isinstance(value[0], BaseModel) and _item_nodes(value) <= STEP_NODES:
            return [item.model_dump() for item in value]  # many small models: one call each
        return [_dump_field(item) for item in value]
    if isinstance(value, dict):
        return {key: _dump_field(item) for key, item in value.items()}
    return value


def json_text(value: Any, ready_members: Mapping[str, str] | None = None) -> str:
    """`value` (plain JSON data) as starlette's JSONResponse writes it, in short steps.
    `ready_members`: members of the dict `value` whose JSON text is already written (it
    replaces theirs, keeping the dict's order)."""
    parts: list[str] = []
    if ready_members:
        parts.append("{")
        for position, (key, item) in enumerate(value.items()):
            parts.append(f"{',' if position else ''}{_dumps(key)}:")
            if key in ready_members:
                parts.append(ready_members[key])
            else:
                _encode(item, parts)
        parts.append("}")
    else:
        _encode(value, parts)
    return "".join(parts)


def _encode(value: Any, out: list[str]) -> None:
    if estimated_nodes(value) <= STEP_NODES:
        out.append(_dumps(value))
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        out.append("{")
        for position, (key, item) in enumerate(value.items()):
            out.append(f"{',' if position else ''}{_dumps(key)}:")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        step = max(1, STEP_NODES // max(1, _item_nodes(value)))
        out.append("[")
        for start in range(0, len(value), step):
            if start:
                out.append(",")
            if step == 1:
                _encode(value[start], out)
            else:  # a slice at a time: "[a,b,c]" without its brackets
                out.append(_dumps(value[start : start + step])[1:-1])
        out.append("]")
    else:  # a long string, or a dict with keys json converts
        out.append(_dumps(value))
