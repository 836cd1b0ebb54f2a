"""Grammar compilation off the engine loop, cached by (constraint, tokenizer).

llguidance compiles lazily (the token trie is shared per tokenizer and masks are computed on
demand), so "compiling" here is: grammar text -> a fresh LLMatcher, cheap even for large
schemas. The expensive part is the tokenizer's trie (seconds for the large vocabularies of
current models, holding the GIL), so it is built once, in the pool, as soon as the engine
starts.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import numpy as np
from transformers import PreTrainedTokenizerFast

from pagoda.sampling_params import KINDS, StructuredOutputsParams
from pagoda.structured.grammar import GrammarError, build_grammar
from pagoda.tokenizer import Tokenizer

# Prometheus-style buckets for the compile time histogram (seconds).
COMPILE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class StructuredOutputStats:
    """Cumulative counters for metrics."""

    compile_time_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_TIME_BUCKETS) + 1))
    compile_time_sum: float = 0.0
    num_compiles: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    num_timeouts: int = 0
    num_failures: int = 0
    requests_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def observe_compile(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(COMPILE_TIME_BUCKETS) if seconds <= bound), len(COMPILE_TIME_BUCKETS))
        self.compile_time_bucket_counts[index] += 1
        self.compile_time_sum += seconds
        self.num_compiles += 1

    def copy(self) -> StructuredOutputStats:
        return StructuredOutputStats(
            list(self.compile_time_bucket_counts),
            self.compile_time_sum,
            self.num_compiles,
            self.cache_queries,
            self.cache_hits,
            self.num_timeouts,
            self.num_failures,
            dict(self.requests_by_kind),
        )


def error_summary(error: str, limit: int = 200) -> str:
    """llguidance's error without what follows its first line (its dumps of the parser state
    and the whole grammar, which hold the request's content)."""
    lines = error.strip().splitlines()
    first = lines[0] if lines else "error"
    return first if len(first) <= limit else first[:limit] + "..."


def _probe(matcher: llguidance.LLMatcher, kind: str) -> None:
    """GrammarError for a grammar llguidance cannot follow past its start.

    llguidance builds its lexer and parser lazily: a grammar too large for them (a regex
    "x{1000000}", a choice of 50,000 options) yields a first mask of EOS alone and fails at the
    first token it takes. A copy takes the first allowed token here, at compile time, so such a
    grammar is a 400 naming its field instead of an empty answer that "stopped"."""
    probe = matcher.deep_copy()
    mask = np.frombuffer(probe.compute_bitmask(), dtype=np.uint32)
    words = np.flatnonzero(mask)
    if not probe.is_error() and len(words):
        word = int(words[0])
        bits = int(mask[word])
        probe.consume_token(word * 32 + (bits & -bits).bit_length() - 1)
    if probe.is_error():
        raise GrammarError(
            f"structured_outputs.{kind}", f"the grammar cannot be honoured ({error_summary(probe.get_error())})"
        )


class GrammarCompiler:
    """Hands out futures of compiled grammars (template matchers, never advanced themselves:
    each request gets a deep copy). Thread-safe; one or more worker threads."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        max_workers: int = 1,
        cache_size: int = 512,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.stats = StructuredOutputStats()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        # Fills the masks of a batch's matchers in parallel (llguidance's own threads); on a
        # machine with few cores the hand-off costs more than it saves.
        self.executor = llguidance.LLExecutor() if (os.cpu_count() or 1) >= 8 else None
        self._tokenizer: Future = self._pool.submit(self._build_tokenizer, eos_token_ids)

    def _build_tokenizer(self, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        # The engine's own loader: a tokenizer directory or a GGUF file's metadata, local files only.
        hf = Tokenizer.from_pretrained(self.tokenizer_path).hf
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        if not isinstance(hf, PreTrainedTokenizerFast):  # llguidance reads the Rust tokenizer
            raise ValueError(f"{type(hf).__name__} is not a fast tokenizer; grammars need one")
        # Every EOS id is allowed exactly where the grammar may end.
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=sorted(eos) or None)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self._tokenizer.result()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled template matcher; raises GrammarError through the future."""
        key = params.cache_key()
        with self._lock:
            self.stats.cache_queries += 1
            self.stats.requests_by_kind[params.kind] += 1
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self.stats.cache_hits += 1
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        tokenizer = self.tokenizer
        started = time.perf_counter()
        grammar = build_grammar(params, tokenizer=tokenizer)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs.{params.kind}", error_summary(matcher.get_error()))
        _probe(matcher, params.kind)
        elapsed = time.perf_counter() - started
        with self._lock:
            self.stats.observe_compile(elapsed)
        return matcher

    def record(self, *, timeout: bool = False, failure: bool = False) -> None:
        with self._lock:
            self.stats.num_timeouts += int(timeout)
            self.stats.num_failures += int(failure)

    def snapshot(self) -> StructuredOutputStats:
        with self._lock:
            return self.stats.copy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
