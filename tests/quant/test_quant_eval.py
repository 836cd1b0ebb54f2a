"""`pagoda eval perplexity`: the engine's perplexity equals transformers' on the same tokens,
windows score every token once, and the CLI prints the delta against full precision."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from model_factory import CORPUS, load_hf_model
from pagoda.cli import main
from pagoda.eval.perplexity import make_windows, perplexity


def test_windows_score_every_token_once() -> None:
    for length, window, stride in ((10, 4, 2), (10, 4, 3), (3, 8, 4), (100, 16, 8), (17, 16, 15)):
        windows = make_windows(list(range(length)), window, stride)
        scored = [t for w in windows for t in w.token_ids[w.first_scored :]]
        assert scored == list(range(1, length))
        assert all(len(w.token_ids) <= window and w.first_scored >= 1 for w in windows)


def test_perplexity_matches_transformers(llama_dir: Path) -> None:
    from pagoda.engine.llm import LLM

    llm = LLM(model=str(llama_dir), kv_cache_memory="16MiB")
    ids = llm.tokenizer.encode(CORPUS[0] + CORPUS[2])
    result = perplexity(llm, [ids], window=len(ids), stride=len(ids) - 1)
    with torch.no_grad():
        loss = load_hf_model(llama_dir)(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert result.num_scored_tokens == len(ids) - 1
    assert math.isclose(result.perplexity, math.exp(loss), rel_tol=1e-4)
    # Sliding windows with less context give a (slightly) different but finite perplexity.
    windowed = perplexity(llm, [ids], window=16, stride=8)
    assert windowed.num_scored_tokens == len(ids) - 1 and windowed.num_windows > 1


def test_cli_prints_delta_against_full_precision(capsys, llama_dir: Path, tmp_path: Path) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, text in enumerate(CORPUS):
        (texts / f"doc{i}.py").write_text(text * 3)
    code = main(
        [
            "eval",
            "perplexity",
            "--model",
            str(llama_dir),
            "--text",
            str(texts),
            "--window",
            "64",
            "--stride",
            "32",
            "--kv-cache-dtype",
            "int8",
            "--quantization",
            "int8",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    full, configured = report["runs"]["full precision"], report["runs"]["configured"]
    assert (full["quantization"], full["kv_cache_dtype"]) == ("none", "auto")
    assert (configured["quantization"], configured["kv_cache_dtype"]) == ("int8", "int8")
    assert report["num_documents"] == len(CORPUS)
    assert math.isclose(report["delta_percent"], (configured["perplexity"] / full["perplexity"] - 1) * 100)
    assert abs(report["delta_percent"]) < 10
