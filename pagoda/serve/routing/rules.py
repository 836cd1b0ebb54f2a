"""A route's rules against one request: first match wins.

A rule matches when every condition it sets holds: the caller's tenant, the request's task tag
(`metadata.task`, or the `x-pagoda-task` header), its class (`metadata.class`, or the
`x-pagoda-class` header: a cost/latency class such as cheap or fast) and its prompt length in
tokens (counted with the tokenizer of the model the rule sends to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.serve.models_file import Route, RouteRule

TASK_HEADER = "x-pagoda-task"
CLASS_HEADER = "x-pagoda-class"


@dataclass(frozen=True)
class RequestFacts:
    """What rules look at, read from the request before it is tokenized."""

    tenant: str
    task: str | None = None
    request_class: str | None = None
    prompt_text: str = ""  # every text of the prompt, joined
    prompt_token_ids: int = 0  # tokens the client sent as ids

    @classmethod
    def of(cls, tenant: str, body: dict[str, Any], headers: Any) -> RequestFacts:
        metadata = body.get("metadata")
        if not isinstance(metadata, dict):
            metadata = {}
        texts: list[str] = []
        ids = 0
        prompt = body.get("prompt")
        for item in prompt if isinstance(prompt, list) else [prompt]:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, int):
                ids += 1
            elif isinstance(item, list):
                ids += len(item)
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(
                    part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
        return cls(
            tenant=tenant,
            task=_text(metadata.get("task")) or _text(headers.get(TASK_HEADER)),
            request_class=_text(metadata.get("class")) or _text(headers.get(CLASS_HEADER)),
            prompt_text="\n".join(texts),
            prompt_token_ids=ids,
        )


def _text(value: Any) -> str | None:
    return value.strip() or None if isinstance(value, str) else None


@dataclass(frozen=True)
class RouteMatch:
    """The rule that matched, and where it was written."""

    route: str
    model: str
    rule_index: int
    rule_line: int


def first_match(route: Route, facts: RequestFacts, count_tokens: Callable[[str, str], int]) -> RouteMatch | None:
    """The first rule of `route` that `facts` satisfy; `count_tokens(model, text)` counts a
    prompt's tokens as `model` would (asked only by rules on length)."""
    for index, rule in enumerate(route.rules):
        if _matches(rule, facts, count_tokens):
            return RouteMatch(route.name, rule.model, index, rule.line)
    return None


def _matches(rule: RouteRule, facts: RequestFacts, count_tokens: Callable[[str, str], int]) -> bool:
    if rule.tenants is not None and facts.tenant not in rule.tenants:
        return False
    if rule.tasks is not None and facts.task not in rule.tasks:
        return False
    if rule.classes is not None and facts.request_class not in rule.classes:
        return False
    if rule.min_prompt_tokens is None and rule.max_prompt_tokens is None:
        return True
    tokens = facts.prompt_token_ids + (count_tokens(rule.model, facts.prompt_text) if facts.prompt_text else 0)
    if rule.min_prompt_tokens is not None and tokens < rule.min_prompt_tokens:
        return False
    return rule.max_prompt_tokens is None or tokens <= rule.max_prompt_tokens
