"""Bounds on every request field that sizes work or memory, checked before the engine sees it.

A request is validated for meaning by SamplingParams and the engine; this module answers a
different question: can this request make the server do unbounded work? `n = 2**31` once made
the engine allocate until the kernel killed it. Each bound here is at least what OpenAI or vLLM
allow, so no well-formed client request is refused, and each refusal is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.serve.errors import bad_request

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128  # OpenAI's bound for n / best_of
    max_logprobs: int = 20  # OpenAI's top_logprobs bound, vLLM's default max_logprobs
    max_stop_strings: int = 64  # OpenAI allows 4; vLLM sets none
    max_stop_string_chars: int = 1024
    # All stop strings together: each step matches every one of them against the text's tail and
    # withholds any tail that may grow into one, work (and a table of every prefix) that grows
    # with their total length. 64 strings of 1,024 characters from one tenant raised another's
    # streaming ITL p99 fivefold.
    max_stop_chars_total: int = 4096
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 2048  # entries
    max_prompts: int = 2048  # prompts in one completions batch (OpenAI's array bound)
    max_messages: int = 8192
    max_content_parts: int = 1024  # per message

    def check(self, body: Any, *, max_num_seqs: int) -> None:
        """Raises a 400 APIError naming the first field over its bound. `body` is a parsed
        completions or chat request (attributes absent on one endpoint are skipped)."""
        max_samples = min(self.max_n, max_num_seqs)
        for name in ("n", "best_of"):
            value = getattr(body, name, None)
            if value is not None and value > max_samples:
                _refuse(
                    name,
                    f"{name} must be at most {max_samples} on this server "
                    f"({'--max-num-seqs' if max_num_seqs < self.max_n else 'the API limit'}), got {value}.",
                )
        # Chat's top_logprobs is bounded by SamplingParams (it is the engine's logprobs).
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(body, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_logprobs:
                _refuse(name, f"{name} must be at most {self.max_logprobs}, got {value}.")
        seed = getattr(body, "seed", None)
        if seed is not None and not INT64_MIN <= seed <= UINT64_MAX:
            _refuse("seed", "seed must fit in 64 bits.")
        self._check_stop(getattr(body, "stop", None))
        _check_count(getattr(body, "stop_token_ids", None), self.max_stop_token_ids, "stop_token_ids")
        _check_count(getattr(body, "logit_bias", None), self.max_logit_bias, "logit_bias")
        prompt = getattr(body, "prompt", None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            _check_count(prompt, self.max_prompts, "prompt")
        messages = getattr(body, "messages", None)
        if messages is not None:
            _check_count(messages, self.max_messages, "messages")
            for message in messages:
                content = getattr(message, "content", None)
                if isinstance(content, list):
                    _check_count(content, self.max_content_parts, "messages")

    def _check_stop(self, stop: str | Sequence[str] | None) -> None:
        if stop is None:
            return
        strings = [stop] if isinstance(stop, str) else list(stop)
        _check_count(strings, self.max_stop_strings, "stop")
        longest = max((len(s) for s in strings), default=0)
        if longest > self.max_stop_string_chars:
            _refuse(
                "stop",
                f"each stop string must be at most {self.max_stop_string_chars} characters, got one of {longest}.",
            )
        total = sum(len(s) for s in strings if isinstance(s, str))
        if total > self.max_stop_chars_total:
            _refuse(
                "stop",
                f"the stop strings may hold at most {self.max_stop_chars_total} characters together, got {total}.",
            )


def _check_count(items: Sequence[Any] | dict | None, limit: int, param: str) -> None:
    if items is not None and len(items) > limit:
        _refuse(param, f"{param} may hold at most {limit} entries, got {len(items)}.")


def _refuse(param: str, message: str) -> None:
    raise bad_request(message, param=param, code="limit_exceeded")
