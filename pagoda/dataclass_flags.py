"""Command-line flags generated from a settings dataclass, and the dataclass back from the flags.

A field is a flag when its metadata carries `help`; the flag is `--field-name` (metadata `flag`
renames it) and its dest is the field's name. The field's type decides the rest: bool ->
`--x/--no-x`, a `Literal` -> its values as the choices, `list[str]` -> one or more values, int
or float (optional or not) -> that type; metadata `parse` replaces the type with a parser of
the flag's text (sizes such as 8MiB, limits that may be 'none'). Choices therefore come from the
same `Literal` the field is typed with, and `check_choices` holds a constructed value to them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import types
import typing
from typing import Any, Literal, TypeVar

T = TypeVar("T")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Each field's type, its annotation resolved in the class's module (as
    typing.get_type_hints does, but field by field: a name imported only for type checking
    resolves to Any, and such a field is never a flag)."""
    namespace = vars(sys.modules[cls.__module__])
    resolved: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        try:
            resolved[f.name] = eval(f.type, namespace) if isinstance(f.type, str) else f.type
        except NameError:
            resolved[f.name] = Any
    return resolved


def _without_none(kind: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (itself, False)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        if len(args) == 1:
            return args[0], True
    return kind, False


def choices(cls: type, name: str) -> tuple[Any, ...] | None:
    """The values field `name` of dataclass `cls` may take (its Literal's), or None when any."""
    kind, _ = _without_none(_field_types(cls)[name])
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def alternatives(values: tuple[Any, ...]) -> str:
    """('mp', 'ray') -> 'mp or ray'; ('a', 'b', 'c') -> 'a, b or c'."""
    words = [str(value) for value in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def check_choices(instance: Any) -> None:
    """ValueError naming the first field of the dataclass `instance` whose value is outside its
    Literal ("dtype must be auto, float32, bfloat16 or float16, got 'x'")."""
    cls: type = type(instance)
    for f in dataclasses.fields(cls):
        allowed = choices(cls, f.name)
        if allowed is None:
            continue
        value = getattr(instance, f.name)
        if value in allowed:
            continue
        if value is None and _without_none(_field_types(cls)[f.name])[1]:
            continue
        raise ValueError(f"{f.name} must be {alternatives(allowed)}, got {value!r}")


def flag_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str, *, skip: tuple[str, ...] = ()) -> None:
    """Add a group `title` of flags to `parser`, one per flag field of the dataclass `cls`."""
    group = parser.add_argument_group(title)
    for f in flag_fields(cls):
        if f.name in skip:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        help_text = f.metadata["help"]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind, _ = _without_none(_field_types(cls)[f.name])
        if kind is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        # A help text that already states its default ("(default: the model's)", "...; default: off")
        # keeps it: one default per flag.
        if "default:" not in help_text and "(default" not in help_text:
            help_text = f"{help_text} (default: {default})"
        if typing.get_origin(kind) is list:  # --lora-modules a=PATH b=PATH
            group.add_argument(
                flag, dest=f.name, nargs="+", default=default, metavar=f.metadata.get("metavar"), help=help_text
            )
            continue
        allowed = choices(cls, f.name)
        parse = f.metadata.get("parse") or (type(allowed[0]) if allowed else kind)
        group.add_argument(
            flag,
            dest=f.name,
            type=parse,
            default=default,
            choices=allowed,
            metavar=f.metadata.get("metavar"),
            help=help_text,
        )


def from_flags(cls: type[T], args: argparse.Namespace, *, skip: tuple[str, ...] = (), **values: Any) -> T:
    """An instance of `cls` from the parsed flags of its flag fields (those not skipped, and not
    given in `values`, which fill or override the rest)."""
    flags = {
        f.name: getattr(args, f.name)
        for f in flag_fields(cls)
        if hasattr(args, f.name) and f.name not in skip and f.name not in values
    }
    return cls(**flags, **values)
