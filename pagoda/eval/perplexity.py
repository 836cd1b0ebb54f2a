"""Perplexity of a model on local text, computed by the engine (prompt logprobs).

Each document is cut into windows of `window` tokens advancing by `stride`; a window scores
only the tokens the previous one did not, each with up to `window - 1` tokens of context (the
sliding-window evaluation of Hugging Face's perplexity guide). Every token after a
document's first is scored exactly once. Perplexity = exp(mean negative log-likelihood).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from pagoda.config import EngineConfig
from pagoda.engine.llm import LLM
from pagoda.eval.options import PerplexityOptions
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
            ids = ids[: budget + 1]
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
        assert entries is not None  # asked for (prompt_logprobs=0)
        for position in range(window_.first_scored, len(window_.token_ids)):
            scored = entries[position]
            assert scored is not None  # only the first prompt token has none; windows score from the second
            nll -= scored[window_.token_ids[position]].logprob
            count += 1
    mean = nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(token_lists), len(windows))


# ---- the `pagoda eval perplexity` run: the configured engine vs full precision ----------------


@dataclass
class PerplexityRun:
    label: str  # "full precision" or "configured"
    config: EngineConfig
    result: PerplexityResult
    seconds: float


def is_full_precision(config: EngineConfig) -> bool:
    return config.quantization == "none" and config.kv_cache_dtype == "auto"


def evaluate_perplexity(options: PerplexityOptions, config: EngineConfig) -> list[PerplexityRun]:
    """Perplexity of the engine as configured and, unless it already is or options.baseline is
    off, of the same model at full precision (weights unquantized, KV in the model dtype), on
    the same tokens. Raises ValueError on bad input."""
    documents = read_documents(options.text)
    configs = [("configured", config)]
    if options.baseline and not is_full_precision(config):
        configs.insert(0, ("full precision", dataclasses.replace(config, quantization="none", kv_cache_dtype="auto")))
    runs = []
    token_lists = None
    for label, engine_config in configs:
        start = time.perf_counter()
        llm = LLM(**{f.name: getattr(engine_config, f.name) for f in dataclasses.fields(engine_config)})
        if token_lists is None:
            token_lists = tokenize_documents(llm, documents, options.max_tokens or None)
        window = min(options.window, llm.engine.core.max_model_len)
        result = perplexity(llm, token_lists, window, min(options.stride, window - 1))
        runs.append(PerplexityRun(label, engine_config, result, time.perf_counter() - start))
        del llm  # free the weights and the KV pool before the next engine is built
    return runs


def delta_percent(runs: list[PerplexityRun]) -> float | None:
    """The configured run's perplexity relative to full precision, in percent (None: no baseline)."""
    by_label = {run.label: run for run in runs}
    if "full precision" not in by_label:
        return None
    return (by_label["configured"].result.perplexity / by_label["full precision"].result.perplexity - 1.0) * 100


def _describe(config: EngineConfig) -> str:
    weights: str
    if config.quantization in ("none", "int8"):
        weights = config.quantization
    else:
        weights = f"int4 g{config.quantization_group_size or 'auto'}{'' if config.quantization_zero_point else ' sym'}"
    return f"weights {weights}, kv {config.kv_cache_dtype}"


def report_json(runs: list[PerplexityRun], options: PerplexityOptions) -> str:
    configured = runs[-1]
    return json.dumps(
        {
            "model": configured.config.model,
            "text": options.text,
            "window": options.window,
            "stride": options.stride,
            "num_scored_tokens": configured.result.num_scored_tokens,
            "num_documents": configured.result.num_documents,
            "runs": {
                run.label: {
                    "perplexity": run.result.perplexity,
                    "mean_nll": run.result.mean_nll,
                    "seconds": round(run.seconds, 2),
                    "quantization": run.config.quantization,
                    "kv_cache_dtype": run.config.kv_cache_dtype,
                }
                for run in runs
            },
            "delta_percent": delta_percent(runs),
        }
    )


def render_report(runs: list[PerplexityRun]) -> str:
    configured = runs[-1]
    lines = [
        f"model {configured.config.model}: {configured.result.num_scored_tokens} tokens scored in "
        f"{configured.result.num_documents} document(s), {configured.result.num_windows} window(s)"
    ]
    for run in runs:
        lines.append(
            f"  {run.label:<15} {_describe(run.config):<32} perplexity {run.result.perplexity:.4f}  "
            f"({run.seconds:.1f}s)"
        )
    delta = delta_percent(runs)
    if delta is not None:
        lines.append(f"  delta vs full precision: {delta:+.2f}%")
    return "\n".join(lines)
