"""vLLM's offline idioms: TextPrompt / TokensPrompt dicts, get_tokenizer(), bundled model names."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig, resolve_model_path
from pagoda.engine.prompt_inputs import normalize_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(model=str(llama_dir), num_kv_blocks=64)


def test_dict_prompts_mixed_with_text_and_ids(llm: LLM) -> None:
    text = "hello world"
    ids = llm.get_tokenizer().encode(text)
    outputs = llm.generate([text, {"prompt": text}, ids, {"prompt_token_ids": ids}], GREEDY)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]
    assert outputs[1].prompt == text and outputs[3].prompt is None
    single = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert [o.outputs[0].token_ids for o in single] == [tokens[0]]


def test_get_tokenizer_is_the_hugging_face_tokenizer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("abc", add_special_tokens=False)) == "abc"
    assert hasattr(tokenizer, "apply_chat_template")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"text": "hi"}, 'needs a "prompt" or "prompt_token_ids" key'),
        ({"prompt_token_ids": ["a"]}, "list of integer token ids"),
        ({"prompt": 5}, '"prompt" must be a string'),
        ([1.5], "must be a string, a list of token ids"),
        (3, "must be a string, a list of token ids"),
        ([], "prompts is empty"),
    ],
)
def test_malformed_prompts_say_what_is_accepted(bad: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(")):
        normalize_prompts(bad)  # type: ignore[arg-type]


def test_bundled_model_names_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_path("pagoda-coder") == str(DEFAULT_MODEL_DIR)
    assert EngineConfig(model="pagoda-coder-draft").model.endswith("pagoda-coder-draft")
    assert resolve_model_path("/some/dir") == "/some/dir"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pagoda-coder").mkdir()  # a local directory of that name wins
    assert resolve_model_path("pagoda-coder") == "pagoda-coder"
