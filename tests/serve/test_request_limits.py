"""Every field that sizes work or memory is bounded before the engine sees the request."""

from __future__ import annotations

import pytest

from pagoda.serve.admission.request_limits import RequestLimits
from pagoda.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.serve.errors import APIError

LIMITS = RequestLimits()


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(n=2**31), "n"),
        (completion(n=129), "n"),
        (completion(best_of=1000), "best_of"),
        (completion(logprobs=21), "logprobs"),
        (completion(seed=2**70), "seed"),
        (completion(stop=["x"] * 65), "stop"),
        (completion(stop="y" * 5000), "stop"),
        (completion(stop_token_ids=list(range(2000))), "stop_token_ids"),
        (completion(logit_bias={str(i): 1.0 for i in range(3000)}), "logit_bias"),
        (CompletionRequest(prompt=["a"] * 3000), "prompt"),
        (ChatCompletionRequest(messages=[{"role": "user", "content": "a"}] * 9000), "messages"),
        (
            ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 2000}]),
            "messages",
        ),
    ],
)
def test_over_the_bound_is_a_400_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(APIError) as refused:
        LIMITS.check(body, max_num_seqs=256)
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.code == "limit_exceeded"


def test_n_is_also_bounded_by_max_num_seqs() -> None:
    with pytest.raises(APIError, match="--max-num-seqs") as refused:
        LIMITS.check(chat(n=9), max_num_seqs=8)
    assert refused.value.param == "n"
    LIMITS.check(chat(n=8), max_num_seqs=8)


def test_requests_at_the_bounds_pass() -> None:
    LIMITS.check(
        completion(
            n=128,
            best_of=128,
            logprobs=20,
            seed=2**64 - 1,
            stop=["s"] * 64,
            logit_bias={"1": 5.0},
            stop_token_ids=[1, 2],
        ),
        max_num_seqs=256,
    )
    LIMITS.check(chat(logprobs=True, top_logprobs=20, seed=-(2**63)), max_num_seqs=256)
    LIMITS.check(CompletionRequest(prompt=list(range(5000))), max_num_seqs=256)  # token ids: bounded by context
