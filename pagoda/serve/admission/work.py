"""What one HTTP request asks of the engine, in the units admission charges.

Admission charges work, not requests: every prompt of a batch runs `n` sequences, and each of
them counts against --max-num-seqs in the engine, against --max-queued-requests in the queue and
against a tenant's max_concurrent_requests. The sequence count is known from the body alone,
so the refusals it decides come before any tokenizing; the token estimate (prompt tokens plus
`n` times each prompt's output limit) is known once the prompts are tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagoda.serve.errors import APIError


@dataclass(frozen=True)
class RequestWork:
    num_prompts: int
    n: int = 1
    # Known after tokenizing; 0 before.
    prompt_tokens: int = 0
    max_output_tokens: int = 0  # summed over the prompts, for one sample each

    @property
    def num_sequences(self) -> int:
        return self.num_prompts * self.n

    @property
    def estimated_tokens(self) -> int:
        """The most tokens the request can cost: its prompts and every sample's output limit."""
        return self.prompt_tokens + self.n * self.max_output_tokens

    def describe_sequences(self) -> str:
        prompts = f"{self.num_prompts} prompt{'s' if self.num_prompts != 1 else ''}"
        return f"{self.num_sequences} sequences ({prompts} x n={self.n})"

    def describe_tokens(self) -> str:
        return (
            f"up to {self.estimated_tokens} tokens ({self.prompt_tokens} prompt + n={self.n} x "
            f"{self.max_output_tokens} output)"
        )

    def with_tokens(self, prompt_tokens: int, max_output_tokens: int) -> RequestWork:
        return replace(self, prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens)


def never_fits(message: str, param: str) -> APIError:
    """A request over a limit it could not meet even on an idle server: retrying cannot help,
    so it is a 400 (a 429 or 503 would make clients retry it)."""
    return APIError(400, message, param=param, code="limit_exceeded")
