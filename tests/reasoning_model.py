"""A tiny random model whose tokenizer has Qwen3's `<think>` / `</think>` (plain added tokens, as
in Qwen3's) and `<tool_call>` / `</tool_call>`, with a Qwen3-style chat template: tools, tool
calls and tool results in the history, and `enable_thinking=false` closing the thinking in the
prompt. `opens_thinking=True` gives a DeepSeek-R1-style template instead, whose prompt ends with
`<think>` opened."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.config import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_HISTORY = (
    "{%- if tools %}Tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}\n{% endif %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "{{ '\\n' }}{% endfor %}"
)
QWEN3_TEMPLATE = _HISTORY + (
    "{%- if add_generation_prompt %}assistant:"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{% endif %}"
)
R1_TEMPLATE = _HISTORY + "{%- if add_generation_prompt %}assistant:<think>\n{% endif %}"


def build_reasoning_model(directory: Path, opens_thinking: bool = False) -> Path:
    from model_factory import build_model
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    tokenizer.add_tokens(
        [
            AddedToken(marker, special=False, normalized=False)
            for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>")
        ]
    )
    build_model(directory, "llama", vocab_size=tokenizer.get_vocab_size())
    for name in TOKENIZER_FILES:
        (directory / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)  # tokenizer.json lists them all
    config["chat_template"] = R1_TEMPLATE if opens_thinking else QWEN3_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def token_id(model_dir: Path, text: str) -> int:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, (text, ids)
    return ids[0]
