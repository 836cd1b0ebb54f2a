"""What `pagoda bench compare` can run: target specs parsed from `KIND[:KEY=VALUE,...]`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TARGET_KINDS = ("pagoda", "pagoda-static", "hf", "http")
TARGET_HELP = """targets (--target, repeatable; ratios are relative to the first):
  pagoda[:KEY=VALUE,...]          the engine in-process; KEYs are EngineConfig fields, e.g.
                                  pagoda:enable_prefix_caching=false,max_num_seqs=8
  pagoda-static:batch=B[,...]     the same engine, but B requests at a time, each group run to
                                  completion before the next starts (static batching)
  hf[:batch_size=B,dtype=float32] transformers generate: static batches, left padding, greedy,
                                  exact output lengths (min_new_tokens = max_new_tokens)
  http:url=URL[,model=NAME,endpoint=chat]   any OpenAI-compatible server, streamed
                                  (a bare http://... URL works too)
  every target also takes label=NAME for the report
"""


@dataclass
class TargetSpec:
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str = ""


def parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_target(text: str) -> TargetSpec:
    text = text.strip()
    if text.startswith(("http://", "https://")):
        return TargetSpec("http", {"url": text}, label=text)
    kind, _, rest = text.partition(":")
    kind = {"transformers": "hf"}.get(kind, kind)
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target kind {kind!r} in {text!r}; use one of {', '.join(TARGET_KINDS)}")
    options: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad target option {item!r} in {text!r}; expected KEY=VALUE")
        options[key.strip().replace("-", "_")] = (
            value.strip() if key.strip() in ("url", "model", "label") else parse_value(value.strip())
        )
    label = str(options.pop("label", text))
    if kind == "http" and "url" not in options:
        raise ValueError(f"target {text!r} needs url=http://HOST:PORT")
    if kind == "pagoda-static" and int(options.get("batch", 0)) < 1:
        raise ValueError(f"target {text!r} needs batch=B with B >= 1")
    if kind == "hf" and int(options.get("batch_size", 1)) < 1:
        raise ValueError(f"target {text!r}: batch_size must be >= 1")
    return TargetSpec(kind, options, label)
