"""Perplexity of a model on local text, computed by the engine (prompt logprobs).

Each document is cut into windows of `window` tokens advancing by `stride`; a window scores
only the tokens the previous one did not, each with up to `window - 1` tokens of context (the
sliding-window evaluation of Hugging Face's perplexity guide). Every token after a
document's first is scored exactly once. Perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pagoda.engine.llm import LLM
from pagoda.sampling_params import SamplingParams

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".c", ".h", ".js", ".html")


@dataclass
class Window:
    token_ids: list[int]
    first_scored: int  # positions [first_scored, len) are scored


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_scored_tokens: int
    num_documents: int
    num_windows: int


def read_documents(path: str | Path) -> list[tuple[str, str]]:
    """(name, text) of a file, or of every text file under a directory (sorted)."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"{path}: no text files ({', '.join(TEXT_SUFFIXES)}) found")
    else:
        raise ValueError(f"{path}: no such file or directory")
    documents = []
    for file in files:
        try:
            documents.append((str(file), file.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            if path.is_file():
                raise ValueError(f"{file}: not UTF-8 text") from None
    return documents


def make_windows(token_ids: list[int], window: int, stride: int) -> list[Window]:
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, window - 1], got stride {stride} with window {window}")
    windows = []
    scored_until = 1  # the first token has no context and is never scored
    for begin in range(0, len(token_ids), stride):
        end = min(begin + window, len(token_ids))
        if end > scored_until:
            windows.append(Window(token_ids[begin:end], scored_until - begin))
            scored_until = end
        if end == len(token_ids):
            break
    return windows


def tokenize_documents(llm: LLM, documents: list[tuple[str, str]], max_tokens: int | None) -> list[list[int]]:
    """Token ids per document, cut so at most `max_tokens` tokens are scored in total."""
    token_lists = []
    budget = max_tokens
    for _, text in documents:
        ids = llm.tokenizer.encode(text)
        if budget is not None:
            ids = ids[:budget + 1]
            budget -= max(len(ids) - 1, 0)
        if len(ids) >= 2:
            token_lists.append(ids)
        if budget is not None and budget <= 0:
            break
    if not token_lists:
        raise ValueError("the text has fewer than 2 tokens: nothing to score")
    return token_lists


def perplexity(llm: LLM, token_lists: list[list[int]], window: int, stride: int) -> PerplexityResult:
    windows = [w for ids in token_lists for w in make_windows(ids, window, stride)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([w.token_ids for w in windows], params)
    nll = 0.0
    count = 0
    for window_, output in zip(windows, outputs):
        entries = output.prompt_logprobs
        for position in range(window_.first_scored, len(window_.token_ids)):
            nll -= entries[position][window_.token_ids[position]].logprob
            count += 1
    mean = nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(token_lists), len(windows))
