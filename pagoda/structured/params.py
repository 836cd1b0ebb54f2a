"""StructuredOutputsParams: what a request's output must match (vLLM's field names).

Kept free of heavy imports: SamplingParams holds one, and the CLI imports SamplingParams.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema (`json`, a dict or its JSON text), a regular
    expression, a list of choices, an EBNF/GBNF or Lark grammar, any JSON object
    (`json_object=True`), or a structural tag (vLLM's `{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`: free text in which each tagged segment follows its schema).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError("structured_outputs must set exactly one of " + ", ".join(KINDS)
                             + (f"; got {', '.join(set_fields)}" if set_fields else ""))
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", list(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty grammar text")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def cache_key(self) -> tuple[str, str]:
        """A canonical key: equal constraints (dict key order aside) share a compiled grammar."""
        spec = self.spec
        if isinstance(spec, (dict, list)):
            text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        else:
            text = str(spec)
        return self.kind, text
