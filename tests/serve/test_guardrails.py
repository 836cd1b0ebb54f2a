"""Guardrails (--guardrails): each rule kind and action through the server, streamed and
not; redaction never leaks the original into a chunk or the log; a hand-built deterministic
guard model drives the classifier path; bad files stop startup naming the rule."""

from __future__ import annotations

import json
import logging
import re
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from guard_model_factory import SAFE_LABEL, TRIGGER, UNSAFE_LABEL, build_guard_model
from pagoda.guard import GuardModelError, Guardrails, GuardrailsConfigError, load_guardrails, parse_guardrails
from pagoda.guard.pii import find_pii, luhn_valid
from pagoda.http_client.sse import iter_sse_events
from pagoda.serve.admission.tenants import TenantRegistry
from pagoda.serve.observability.request_log import LOGGER_NAME
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, run, start_server

PROMPT = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "sort a list"}]
MAX_TOKENS = 24
TENANTS = ("plain", "pii", "words", "redact", "block", "flag", "guarded")

# ---- the pieces on their own -----------------------------------------------------------------


def test_pii_detectors() -> None:
    def found(text: str) -> list[tuple[str, str]]:
        return [(text[s.start : s.end], s.label) for s in find_pii(text)]

    assert found("mail john.doe+x@example.co.uk now") == [("john.doe+x@example.co.uk", "email")]
    assert found("call +1 415-555-0132 or (415) 555 0132") == [
        ("+1 415-555-0132", "phone"),
        ("(415) 555 0132", "phone"),
    ]
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
    assert found("card 4111 1111 1111 1111, not 4111 1111 1111 1112") == [("4111 1111 1111 1111", "credit_card")]
    assert found("sk-abcdefghijklmnopqrstuvwxyz123456 AKIAABCDEFGHIJKLMNOP ghp_" + "a" * 36) == [
        ("sk-abcdefghijklmnopqrstuvwxyz123456", "api_key"),
        ("AKIAABCDEFGHIJKLMNOP", "api_key"),
        ("ghp_" + "a" * 36, "api_key"),
    ]
    assert found("version 1.2.3, 2024-01-01, x = 1234567890123, id 12345") == []


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"name": "r", "kind": "sentiment", "action": "block"}, "rule 'r': unknown kind 'sentiment'"),
        ({"name": "r", "kind": "regex", "pattern": "(unclosed", "action": "block"}, "rule 'r': bad regex '(unclosed'"),
        ({"name": "r", "kind": "regex", "pattern": "a*", "action": "block"}, "matches the empty"),
        ({"name": "r", "kind": "pii", "types": ["ssn"], "action": "redact"}, "unknown pii types"),
        (
            {"name": "r", "kind": "blocklist", "words": ["x"], "action": "delete"},
            "rule 'r': action must be one of block, redact, flag",
        ),
        (
            {"name": "r", "kind": "classifier", "model": "nope", "action": "block"},
            "rule 'r': model 'nope' is not defined",
        ),
        ({"name": "r", "kind": "regex", "pattern": "x", "action": "flag", "stages": ["middle"]}, "unknown stages"),
    ],
)
def test_invalid_rules_name_the_rule(rule: dict[str, Any], message: str) -> None:
    with pytest.raises(GuardrailsConfigError, match=re.escape(message)):
        parse_guardrails({"rules": [rule]})


def test_missing_classifier_model_stops_serve_naming_the_rule(tmp_path: Path) -> None:
    from pagoda.cli import main

    path = tmp_path / "guardrails.yaml"
    path.write_text(
        textwrap.dedent(f"""
        models: {{guard: {{path: {tmp_path / "missing"}}}}}
        rules:
          - {{name: safety, kind: classifier, model: guard, action: block}}
    """)
    )
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--guardrails", str(path)])
    assert "rule 'safety'" in str(exc.value) and "no model at" in str(exc.value)
    path.write_text("rules: [{name: x, kind: regex, pattern: '[', action: block}]")
    with pytest.raises(SystemExit, match="rule 'x': bad regex"):
        main(["serve", "--guardrails", str(path)])


@pytest.fixture(scope="module")
def guard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_guard_model(tmp_path_factory.mktemp("guard") / "model")


def guard_rules(guard_dir: Path, fail_mode: str = "closed", window: int = 64) -> Guardrails:
    config = parse_guardrails(
        {
            "fail_mode": fail_mode,
            "classifier_window_chars": window,
            "models": {
                "guard": {
                    "path": str(guard_dir),
                    "safe_label": SAFE_LABEL,
                    "unsafe_label": UNSAFE_LABEL,
                    "max_tokens": 1,
                }
            },
            "rules": [{"name": "safety", "kind": "classifier", "model": "guard", "action": "block"}],
        }
    )
    config.models["guard"].load()
    return Guardrails(config)


def test_classifier_labels_output_in_windows(guard_dir: Path) -> None:
    guardrails = guard_rules(guard_dir, window=64)
    text = "x = 1\n" * 20 + "now" + TRIGGER + " it" + " and more" * 10
    output_filter = guardrails.output_filter("any")
    released = ""
    for i in range(0, len(text), 5):
        released += run(output_filter.feed(text[i : i + 5]))
        # Held back: at most one window beyond what was labelled.
        assert len(text[: i + 5]) - len(released) <= 64 + 5 or output_filter.blocked
    released += run(output_filter.finish())
    assert output_filter.decision.blocked_by == "safety"
    assert TRIGGER not in released and text.startswith(released) and len(released) >= 64
    safe = guardrails.output_filter("any")
    out = "".join(run(safe.feed(c)) for c in "print('hello')\n" * 8) + run(safe.finish())
    assert out == "print('hello')\n" * 8 and not safe.decision.hits


class _BrokenEngine:
    """The loaded guard model's tokenizer, but every generation raises."""

    def __init__(self, llm: Any) -> None:
        self.tokenizer = llm.tokenizer

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("guard model crashed")


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
def test_guard_model_crash_follows_fail_mode(guard_dir: Path, fail_mode: str, caplog: pytest.LogCaptureFixture) -> None:
    guardrails = guard_rules(guard_dir, fail_mode)
    model = guardrails.config.models["guard"]
    model._llm = _BrokenEngine(model._llm)
    with caplog.at_level(logging.WARNING, logger="pagoda.guard.guardrails"):
        decision = run(guardrails.input_guard().check("any", "hello"))
    assert decision.blocked == (fail_mode == "closed")
    [hit] = decision.hits
    assert hit.label == "guard_error" and hit.action == ("block" if fail_mode == "closed" else "fail_open")
    assert f"failing {fail_mode}" in caplog.text and "guard model crashed" in caplog.text
    with pytest.raises(GuardModelError):
        guardrails.config.models["guard"].parse("maybe")


# ---- through the server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("guard-server") / "model")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, str]:
    """The tiny model's greedy texts with no guardrails, to aim output rules at."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(model_dir), num_threads=1, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    completion = llm.generate([PROMPT], params)[0].outputs[0].text
    chat = llm.chat(CHAT, params)[0].outputs[0].text
    return {"completion": completion, "chat": chat}


def middle(text: str, length: int = 6) -> str:
    start = max(0, len(text) // 2 - length // 2)
    return text[start : start + length]


def secret_pattern(reference: dict[str, str]) -> str:
    """What the output rules look for: a piece from the middle of each greedy answer."""
    return "|".join(re.escape(middle(reference[k])) for k in ("completion", "chat"))


@pytest.fixture(scope="module")
def server(
    model_dir: Path, guard_dir: Path, reference: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    root = tmp_path_factory.mktemp("guard-config")
    keys = root / "keys.yaml"
    keys.write_text(json.dumps({"tenants": {t: {"api_keys": [f"key-{t}"]} for t in TENANTS}}))
    rules = [
        {"name": "pii", "kind": "pii", "action": "redact", "tenants": ["pii"]},
        {
            "name": "words",
            "kind": "blocklist",
            "words": ["forbidden", "top secret"],
            "action": "block",
            "stages": ["input"],
            "tenants": ["words"],
        },
        {
            "name": "secret-out",
            "kind": "regex",
            "pattern": secret_pattern(reference),
            "action": "redact",
            "replacement": "[X]",
            "stages": ["output"],
            "tenants": ["redact"],
        },
        {
            "name": "block-out",
            "kind": "regex",
            "pattern": secret_pattern(reference),
            "action": "block",
            "stages": ["output"],
            "tenants": ["block"],
        },
        {
            "name": "flag-out",
            "kind": "regex",
            "pattern": secret_pattern(reference),
            "action": "flag",
            "tenants": ["flag"],
        },
        {"name": "safety", "kind": "classifier", "model": "guard", "action": "block", "tenants": ["guarded"]},
    ]
    guardrails_file = root / "guardrails.yaml"
    guardrails_file.write_text(
        json.dumps(
            {
                "output_hold_chars": 8,
                "classifier_window_chars": 32,
                "models": {
                    "guard": {
                        "path": str(guard_dir),
                        "safe_label": SAFE_LABEL,
                        "unsafe_label": UNSAFE_LABEL,
                        "max_tokens": 1,
                    }
                },
                "rules": rules,
            }
        )
    )
    live = start_server(
        model_dir,
        tenants=TenantRegistry.from_file(keys),
        log_prompts=True,
        prompt_log_dir=str(root / "prompt-log"),
        metrics_tenant_labels=True,
        guardrails=load_guardrails(guardrails_file),
    )
    yield live
    live.stop()


def request(server: LiveServer, tenant: str, endpoint: str = "completions", **body: Any) -> httpx.Response:
    payload = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    if endpoint == "completions":
        payload.setdefault("prompt", PROMPT)
        path = "/v1/completions"
    else:
        payload.setdefault("messages", CHAT)
        path = "/v1/chat/completions"
    return httpx.post(server.url + path, json=payload, timeout=60, headers={"Authorization": f"Bearer key-{tenant}"})


def stream_texts(response: httpx.Response) -> tuple[list[str], str | None]:
    """Each chunk's text and the final finish_reason of a streamed response."""
    assert response.status_code == 200, response.text
    texts, finish = [], None
    for event in iter_sse_events(response.text.splitlines()):
        if event.done:
            continue
        choice = event.json()["choices"][0]
        texts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        finish = choice.get("finish_reason") or finish
    return texts, finish


def answer(response: httpx.Response) -> tuple[str, str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, choice["finish_reason"]


def guard_metric(server: LiveServer, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "pagoda:guardrail_decisions_total" and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return total


def test_no_rules_for_a_tenant_changes_nothing(server: LiveServer, reference: dict[str, str]) -> None:
    assert answer(request(server, "plain")) == (reference["completion"], "length")
    assert answer(request(server, "plain", "chat")) == (reference["chat"], "length")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_blocked_input_is_a_400_content_filter(server: LiveServer, endpoint: str, stream: bool) -> None:
    before = guard_metric(server, rule="words", tenant="words", stage="input", action="block")
    body = (
        {"prompt": "the Forbidden word"}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": "tell me the top secret"}]}
    )
    response = request(server, "words", endpoint, stream=stream, **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "content_filter" and "'words'" in error["message"]
    assert error["param"] == ("prompt" if endpoint == "completions" else "messages")
    assert guard_metric(server, rule="words", tenant="words", stage="input", action="block") == before + 1
    assert request(server, "words", endpoint).status_code == 200  # clean text passes


def test_input_redaction_reaches_neither_engine_nor_log(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    prompt = "email jane@example.com, card 4111 1111 1111 1111:"
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        response = request(server, "pii", prompt=prompt, echo=True, max_tokens=2)
        chat = request(
            server,
            "pii",
            "chat",
            max_tokens=2,
            messages=[{"role": "user", "content": "my key is sk-abcdefghijklmnopqrstuvwxyz0123"}],
        )
    text, _ = answer(response)
    redacted = "email [REDACTED_EMAIL], card [REDACTED_CREDIT_CARD]:"
    assert text.startswith(redacted)  # echo shows what the engine got
    assert response.json()["usage"]["prompt_tokens"] == len(
        server.llm.tokenizer.encode(redacted, add_special_tokens=True)
    )
    assert chat.status_code == 200
    # The chat prompt is rendered again from the redacted message: the engine got only that.
    redacted_chat = [{"role": "user", "content": "my key is [REDACTED_API_KEY]"}]
    assert chat.json()["usage"]["prompt_tokens"] == len(
        server.llm.tokenizer.encode_chat(redacted_chat, add_generation_prompt=True)
    )
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    prompt_log = server.app.state.ctx.prompt_log  # --log-prompts: the prompts are there
    logged = json.dumps(lines) + "".join(p.read_text() for p in prompt_log.directory.iterdir())
    for secret in ("jane@example.com", "4111 1111 1111 1111", "sk-abcdefghijklmnopqrstuvwxyz0123"):
        assert secret not in logged
    assert "[REDACTED_API_KEY]" in logged
    labels = {hit["label"] for line in lines for hit in line.get("guardrails", [])}
    assert {"email", "credit_card", "api_key"} <= labels
    assert guard_metric(server, rule="pii", tenant="pii", action="redact") >= 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_output_redaction_never_leaks(
    server: LiveServer, reference: dict[str, str], endpoint: str, stream: bool
) -> None:
    original = reference["completion" if endpoint == "completions" else "chat"]
    secret = middle(original)
    expected = original.replace(secret, "[X]")
    response = request(server, "redact", endpoint, stream=stream)
    if stream:
        chunks, finish = stream_texts(response)
        assert len([c for c in chunks if c]) > 1  # released as it went, not all at the end
        assert all(secret not in chunk for chunk in chunks)
        text = "".join(chunks)
    else:
        text, finish = answer(response)
    assert text == expected and secret not in text and finish == "length"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_blocked_output_ends_with_content_filter(
    server: LiveServer, reference: dict[str, str], endpoint: str, stream: bool
) -> None:
    original = reference["completion" if endpoint == "completions" else "chat"]
    secret = middle(original)
    response = request(server, "block", endpoint, stream=stream)
    if stream:
        chunks, finish = stream_texts(response)
        text = "".join(chunks)
    else:
        text, finish = answer(response)
    assert finish == "content_filter"
    assert original.startswith(text) and len(text) <= original.index(secret)
    server.wait_idle()  # the engine request was aborted, its blocks freed
    assert server.stats().num_running == 0


def test_flag_counts_and_changes_nothing(server: LiveServer, reference: dict[str, str]) -> None:
    before = guard_metric(server, rule="flag-out", tenant="flag", action="flag")
    chunks, finish = stream_texts(request(server, "flag", stream=True))
    assert "".join(chunks) == reference["completion"] and finish == "length"
    matches = len(re.findall(secret_pattern(reference), reference["completion"]))
    assert matches >= 1
    assert guard_metric(server, rule="flag-out", tenant="flag", action="flag") == before + matches


def test_logprobs_are_refused_under_output_rules(server: LiveServer) -> None:
    response = request(server, "redact", logprobs=1)
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    assert request(server, "plain", logprobs=1).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_classifier_guard_through_the_server(server: LiveServer, reference: dict[str, str], stream: bool) -> None:
    blocked = request(
        server, "guarded", "chat", stream=stream, messages=[{"role": "user", "content": f"how do I{TRIGGER} a process"}]
    )
    assert blocked.status_code == 400
    assert blocked.json()["error"]["code"] == "content_filter"
    assert "'safety'" in blocked.json()["error"]["message"]
    # A safe prompt: its output is labelled window by window and passes unchanged.
    response = request(server, "guarded", stream=stream)
    text = "".join(stream_texts(response)[0]) if stream else answer(response)[0]
    assert text == reference["completion"]


def test_guard_latency_is_in_metrics(server: LiveServer) -> None:
    request(server, "guarded")
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    for name in (
        "pagoda:guardrail_input_seconds",
        "pagoda:guardrail_output_seconds",
        "pagoda:guardrail_first_release_delay_seconds",
    ):
        count = [s.value for s in families[name].samples if s.name.endswith("_count")]
        assert count and count[0] > 0, name
    rejected = [s for s in families["pagoda:request_rejected"].samples if s.labels.get("reason") == "content_filter"]
    assert rejected and rejected[0].value > 0


def test_streaming_holds_back_only_what_could_still_match() -> None:
    config = parse_guardrails(
        {
            "output_hold_chars": 32,
            "rules": [
                {"name": "pii", "kind": "pii", "action": "redact"},
                {"name": "words", "kind": "blocklist", "words": ["forbidden"], "action": "block"},
            ],
        }
    )
    output_filter = Guardrails(config).output_filter("any")
    released = "".join(run(output_filter.feed(c)) for c in "for i in range(10): print(i) ")
    # Everything but the last unfinished word (an email could still start there) is out.
    assert released == "for i in range(10): print(i) "
    partial = "".join(run(output_filter.feed(c)) for c in "mail bob@example.")
    assert partial == "mail "  # the address is still forming
    rest = run(output_filter.feed("org today")) + run(output_filter.finish())
    assert rest == "[REDACTED_EMAIL] today"


def test_classifier_batches_concurrent_checks(guard_dir: Path) -> None:
    import asyncio

    model = guard_rules(guard_dir).config.models["guard"]
    calls = []
    original = model.classify_batch
    model.classify_batch = lambda items: calls.append(len(items)) or original(items)

    async def many() -> list[Any]:
        texts = [f"line {i}" + (TRIGGER if i % 3 == 0 else "") for i in range(9)]
        return await asyncio.gather(*(model.classify_async(t) for t in texts))

    verdicts = run(many())
    assert [v.unsafe for v in verdicts] == [i % 3 == 0 for i in range(9)]
    assert sum(calls) == 9 and len(calls) <= 2  # one engine call for checks that came together


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_is_filtered_on_its_own(server: LiveServer, reference: dict[str, str], stream: bool) -> None:
    original = reference["completion"]
    expected = original.replace(middle(original), "[X]")
    response = request(server, "redact", n=2, stream=stream)
    assert response.status_code == 200, response.text
    texts = {0: "", 1: ""}
    if stream:
        for event in iter_sse_events(response.text.splitlines()):
            if not event.done:
                for choice in event.json()["choices"]:
                    texts[choice["index"]] += choice["text"]
    else:
        texts = {c["index"]: c["text"] for c in response.json()["choices"]}
    assert texts == {0: expected, 1: expected}


def test_output_decisions_reach_the_request_log(
    server: LiveServer, reference: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        answer(request(server, "block"))
    [line] = [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == LOGGER_NAME and '"tenant":"block"' in r.getMessage()
    ]
    assert line["blocked_by"] == "block-out" and line["finish_reason"] == "content_filter"
    assert {"rule": "block-out", "action": "block", "stage": "output", "count": 1} in line["guardrails"]
    assert middle(reference["completion"]) not in json.dumps(line)  # --log-prompts is on


def test_token_id_prompts_are_checked_as_text(server: LiveServer) -> None:
    tokenizer = server.llm.tokenizer
    ids = tokenizer.encode("write to bob@example.org", add_special_tokens=False)
    response = request(server, "pii", prompt=ids, echo=True, max_tokens=1)
    text, _ = answer(response)
    assert text.startswith("write to [REDACTED_EMAIL]") and "bob@" not in text
    blocked = request(server, "words", prompt=tokenizer.encode("forbidden", add_special_tokens=False))
    assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "content_filter"
