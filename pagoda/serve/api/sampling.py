"""OpenAI request fields -> SamplingParams, with the model's generation defaults underneath."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import SamplingParams
from pagoda.serve.api.protocol import SamplingFields
from pagoda.serve.errors import bad_request, invalid_request

# Knobs for which the model's generation_config.json supplies a default when the client
# leaves them out.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        parsed[token_id] = value
    return parsed


def build_sampling_params(
    request: SamplingFields,
    defaults: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Raises a 400 APIError naming the parameter when a value is invalid."""
    values: dict[str, Any] = {}
    if request.use_beam_search:  # it ranks raw log-probabilities: no sampling defaults apply
        defaults = {}
    for name in DEFAULTABLE:
        value = getattr(request, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            values[name] = value
    stop = request.stop
    values.update(
        n=request.n,
        seed=request.seed,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(request.stop_token_ids or []),
        logit_bias=parse_logit_bias(request.logit_bias),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
        use_beam_search=request.use_beam_search,
        best_of=getattr(request, "best_of", None),
        length_penalty=request.length_penalty,
        early_stopping=request.early_stopping,
    )
    try:
        return SamplingParams(**{k: v for k, v in values.items() if k in _SAMPLING_FIELDS})
    except InvalidRequest as exc:
        raise invalid_request(exc) from None
