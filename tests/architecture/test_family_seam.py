"""Architecture names stay in their families: outside pagoda/model/families/ (the family modules
and their registry), pagoda/ names no transformers architecture (`*ForCausalLM`) and no GGUF
`general.architecture`, so adding a family touches its module and one registry line only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pagoda.model import families

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "pagoda"
FAMILIES_DIR = PACKAGE_DIR / "model" / "families"
ARCHITECTURE_LITERAL = re.compile(r"\w+ForCausalLM")
# Strings that spell a GGUF architecture and mean something else.
NOT_ARCHITECTURES = {("pagoda/config.py", "qwen3")}  # the qwen3 reasoning parser (serve/api/reasoning.py)
# Modules whose strings name tokenizers, not architectures: `tokenizer.ggml.model` ("llama" is
# SentencePiece) and `tokenizer.ggml.pre` ("qwen2", "llama3", ...) values.
TOKENIZER_NAME_MODULES = {"pagoda/gguf_tokenizer.py"}


def modules_outside_families() -> list[Path]:
    return [path for path in sorted(PACKAGE_DIR.rglob("*.py")) if FAMILIES_DIR not in path.parents]


def test_no_architecture_is_named_outside_its_family() -> None:
    wrong = []
    for path in modules_outside_families():
        text = path.read_text()
        where = path.relative_to(PACKAGE_DIR.parent)
        # anywhere, docstrings and comments included
        wrong += [f"{where}: {name}" for name in families.architectures() if name in text]
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if (str(where), node.value) in NOT_ARCHITECTURES:
                    continue
                if str(where) in TOKENIZER_NAME_MODULES and not ARCHITECTURE_LITERAL.fullmatch(node.value):
                    continue
                if ARCHITECTURE_LITERAL.fullmatch(node.value) or node.value in families.gguf_architectures():
                    wrong.append(f"{where}:{node.lineno}: {node.value!r}")
    assert wrong == []


def test_the_check_sees_the_families() -> None:
    # Guard against a registry or walk that silently finds nothing.
    assert "LlamaForCausalLM" in families.architectures() and "qwen2moe" in families.gguf_architectures()
    assert len(modules_outside_families()) > 100
    for name in families.architectures():
        assert families.is_supported(name)
        assert families.family(families.family_name(name, "")).FAMILY.read_config is not None
    for name in families.gguf_architectures():
        assert families.gguf_family(name).FAMILY.gguf is not None


def test_every_family_has_test_parameters() -> None:
    # A family added to the registry joins the parity tests through its tiny model.
    from model_factory import TINY_MODELS

    assert {model.model_class for model in TINY_MODELS.values()} == set(families.architectures())
