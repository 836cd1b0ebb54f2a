"""From parsed flags to the dataclasses the domain modules take."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def options_from_args(cls: type[T], args: argparse.Namespace, **values: Any) -> T:
    """An instance of the dataclass `cls` from the flags whose dest names one of its fields;
    `values` fill (or override) the rest."""
    known = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.init and hasattr(args, f.name) and f.name not in values
    }
    return cls(**known, **values)
