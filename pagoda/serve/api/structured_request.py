"""Request fields that constrain the output -> StructuredOutputsParams, validated up front.

Accepted, for chat and completions alike:
- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict"}} (`strict` or not, the schema is enforced);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object" |
  "structural_tag"}, and its older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` fields.
At most one of them may constrain a request. A bad schema, regex or grammar is a 400 naming
the field; checking needs no tokenizer and takes milliseconds, so only valid grammars ever
wait for compilation in the engine.
"""

from __future__ import annotations

from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import KINDS, SamplingParams, StructuredOutputsParams
from pagoda.serve.errors import bad_request, invalid_request
from pagoda.structured.grammar import GrammarError, build_grammar

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def with_structured_outputs(params: SamplingParams, request: Any) -> SamplingParams:
    """`params` constrained as the request asks (unchanged when it asks nothing). The grammar
    check blocks (a schema with thousands of properties takes a few hundred ms): callers run
    it off the event loop, as GenerationEndpoint.handle runs `prepare`."""
    constraint = requested_structured_outputs(request)
    if constraint is None:
        return params
    try:
        return params.clone(structured_outputs=constraint)
    except InvalidRequest as exc:  # a constraint the other params rule out (use_beam_search)
        raise invalid_request(exc) from None


def check_grammar(params: StructuredOutputsParams, field: str) -> None:
    """Raises a 400 APIError naming `field` when the constraint cannot be compiled."""
    try:
        build_grammar(params, field=field)
    except GrammarError as exc:
        raise bad_request(f"Invalid {exc.field}: {exc.reason}", param=exc.field) from None


def requested_structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """The request's constraint, its grammar checked, or None. Raises a 400 APIError naming
    the field."""
    extra = dict(request.model_extra or {})
    sources: list[tuple[str, StructuredOutputsParams]] = []

    response_format = getattr(request, "response_format", None)
    if response_format is None:
        response_format = extra.get("response_format")
    if response_format is not None:
        found = _from_response_format(_as_dict(response_format))
        if found is not None:
            sources.append(("response_format", found))

    structured = extra.get("structured_outputs")
    if structured is not None:
        sources.append(("structured_outputs", _from_structured_outputs(structured)))

    for name, kind in GUIDED_FIELDS.items():
        value = extra.get(name)
        if value is not None:
            sources.append((name, _make(name, **{kind: value})))

    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise bad_request(
            f"Only one of response_format, structured_outputs and guided_* may constrain the output; got {names}.",
            param=sources[1][0],
        )
    field, params = sources[0]
    param_name = field if field != "structured_outputs" else f"structured_outputs.{params.kind}"
    if field == "response_format":
        param_name = "response_format.json_schema.schema" if params.kind == "json" else "response_format"
    check_grammar(params, param_name)
    return params


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format.json_schema is required with type 'json_schema'.", param="response_format.json_schema"
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object.",
                param="response_format.json_schema.schema",
            )
        return _make("response_format.json_schema.schema", json=schema)
    if kind == "structural_tag":  # vLLM's extension of response_format
        return _make("response_format", structural_tag=response_format)
    raise bad_request(
        f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'.",
        param="response_format",
    )


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object.", param="structured_outputs")
    # vLLM also accepts options beside the constraint; those that change nothing here are dropped.
    constraint = {k: v for k, v in value.items() if k in KINDS and v is not None and v is not False}
    unknown = sorted(
        set(value)
        - set(KINDS)
        - {
            "disable_any_whitespace",
            "disable_fallback",
            "disable_additional_properties",
            "whitespace_pattern",
            "backend",
        }
    )
    if unknown:
        raise bad_request(
            f"structured_outputs.{unknown[0]} is not supported; use one of {', '.join(KINDS)}.",
            param=f"structured_outputs.{unknown[0]}",
        )
    return _make("structured_outputs", **constraint)


def _make(field: str, **constraint: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**constraint)
    except ValueError as exc:
        # The constraint's own field when it names one under this field (structured_outputs.choice).
        param = getattr(exc, "param", None)
        if field == "structured_outputs" and isinstance(param, str) and param.startswith("structured_outputs."):
            field = param
        raise bad_request(f"Invalid {field}: {exc}", param=field) from None


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, dict):
        return value
    raise bad_request("response_format must be an object.", param="response_format")


__all__ = ["check_grammar", "requested_structured_outputs", "with_structured_outputs"]
