"""SamplingParams: every per-request generation knob, validated once with a clear error."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.errors import InvalidRequest

# Below this temperature a request is treated as greedy (argmax), as vLLM does.
GREEDY_TEMPERATURE_EPS = 1e-5

MAX_LOGPROBS = 20

# Beam search reads each beam's top (width + end-of-sequence tokens) next tokens from the
# engine's logprobs (at most MAX_LOGPROBS), so the width leaves room for a few EOS tokens.
MAX_BEAM_WIDTH = 16
EARLY_STOPPING = (True, False, "never")
# |length_penalty| bound: a beam's length raised to it stays a finite, non-zero float.
MAX_LENGTH_PENALTY = 10.0


# ---- structured output (decoded under a grammar: pagoda/structured) ----------------------------
# Here, beside SamplingParams (as in vLLM), because SamplingParams holds one; the grammar
# machinery that serves it lives in pagoda/structured, above the request layer.

# The grammar engine's parser follows at most this many alternatives of one rule (llguidance's
# row limit): a longer choice list could never be honoured, and building it takes seconds.
MAX_CHOICES = 2000
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema (`json`, a dict or its JSON text), a regular
    expression, a list of choices, an EBNF/GBNF or Lark grammar, any JSON object
    (`json_object=True`), or a structural tag (vLLM's `{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`: free text in which each tagged segment follows its schema).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise InvalidRequest(
                "structured_outputs must set exactly one of "
                + ", ".join(KINDS)
                + (f"; got {', '.join(set_fields)}" if set_fields else ""),
                param="structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise InvalidRequest(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)",
                param="structured_outputs.json",
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequest("structured_outputs.regex must be a string", param="structured_outputs.regex")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise InvalidRequest(
                    "structured_outputs.choice must be a non-empty list of strings", param="structured_outputs.choice"
                )
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequest(
                    f"structured_outputs.choice has {len(self.choice)} options; at most {MAX_CHOICES} can be followed",
                    param="structured_outputs.choice",
                )
            object.__setattr__(self, "choice", list(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequest(
                "structured_outputs.grammar must be a non-empty grammar text", param="structured_outputs.grammar"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def cache_key(self) -> tuple[str, str]:
        """A canonical key: equal constraints (dict key order aside) share a compiled grammar."""
        spec = self.spec
        if isinstance(spec, (dict, list)):
            text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        else:
            text = str(spec)
        return self.kind, text


@dataclass
class SamplingParams:
    """How to turn logits into tokens for one request.

    Field names and defaults follow vLLM's ``SamplingParams`` so clients can move over unchanged.
    Invalid values raise ``InvalidRequest`` (a ValueError) whose ``param`` names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per output token (0: only the sampled token)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Grammar-constrained output (JSON schema, regex, choice, grammar, ...); see pagoda/structured.
    structured_outputs: StructuredOutputsParams | None = None
    # Only these tokens may be sampled (vLLM's field); None: any.
    allowed_token_ids: list[int] | None = None
    # Words never to generate: a word's last token is banned wherever the output already ends
    # with the word's other tokens (vLLM's semantics). The engine tokenizes them into
    # `bad_words_token_ids` (`tokenize_bad_words`) when the request is added.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # A pooling request (pagoda/worker/pooling.py): the prompt's final hidden states pooled
    # by "last" or "mean" come back as the output's `embedding`, or with "classify" the
    # classifier head's logits over the last one (a scoring or classification request);
    # nothing is decoded after the prefill's one token (max_tokens 1).
    pooling: str | None = None
    # Beam search (vLLM's fields; scored as transformers' `num_beams` generation, see
    # pagoda/engine/beam_search.py): `best_of` beams (None: n), the n best returned, best first.
    # Deterministic: temperature, top_p, top_k, min_p and seed do not apply.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers'

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.validate()

    def validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise InvalidRequest(f"{param} {message}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0.0 <= self.temperature or not math.isfinite(self.temperature):  # 1e400 parses as inf
            fail("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0 or not math.isfinite(self.repetition_penalty):
            fail("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if token_id < 0:
                    fail("logit_bias", f"has a negative token id {token_id}")
                if not -100.0 <= bias <= 100.0:
                    fail("logit_bias", f"value for token {token_id} must be in [-100, 100], got {bias}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "must contain only non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must contain only non-negative integers")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                fail("allowed_token_ids", "must not be empty (null allows every token)")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                fail("allowed_token_ids", "must contain only non-negative integers")
        if self.pooling is not None and self.pooling not in ("last", "mean", "classify"):
            fail("pooling", f"must be 'last', 'mean' or 'classify', got {self.pooling!r}")
        if self.bad_words is not None:
            if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                fail("bad_words", "must contain only non-blank strings")
        self._validate_beam_search(fail)

    def _validate_beam_search(self, fail: Callable[[str, str], None]) -> None:
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or isinstance(self.best_of, bool) or self.best_of < self.n:
                fail("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
            if self.best_of != self.n and not self.use_beam_search:
                fail("best_of", f"({self.best_of}) different from n ({self.n}) needs use_beam_search")
        if self.early_stopping not in EARLY_STOPPING or not isinstance(self.early_stopping, (bool, str)):
            fail("early_stopping", f'must be true, false or "never", got {self.early_stopping!r}')
        if (
            not isinstance(self.length_penalty, (int, float))
            or isinstance(self.length_penalty, bool)
            or not math.isfinite(self.length_penalty)
            or abs(self.length_penalty) > MAX_LENGTH_PENALTY
        ):
            fail(
                "length_penalty",
                f"must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {self.length_penalty!r}",
            )
        if not self.use_beam_search:
            return
        if self.beam_width > MAX_BEAM_WIDTH:
            fail(
                "best_of" if self.best_of is not None else "n",
                f"(the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search, got {self.beam_width}",
            )
        # Beam search ranks the model's raw log-probabilities: what reshapes them or cuts the
        # output short would be silently ignored, so it is refused.
        refused = {
            "structured_outputs": self.structured_outputs is not None,
            "stop": bool(self.stop),
            "min_tokens": self.min_tokens > 0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "pooling": self.pooling is not None,
        }
        for name, is_set in refused.items():
            if is_set:
                fail(
                    name, "is not supported with use_beam_search (beam search ranks the model's raw log-probabilities)"
                )

    @property
    def beam_width(self) -> int:
        """How many beams a beam search keeps: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_sequences(self) -> int:
        """The sequences this request runs at once (what admission charges): the beam width
        for a beam search, else n."""
        return self.beam_width if self.use_beam_search else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def bans_tokens(self) -> bool:
        """Whether the sampler masks tokens for this request (allowed_token_ids, bad_words)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def tokenize_bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each bad word's token ids, as vLLM tokenizes them: the word as written, and with a
    leading space too when that makes a different token sequence of the same length (a word in
    the middle of text), so the word is banned at the start and after a space.
    `tokenizer.encode(text, add_special_tokens=False)` -> token ids."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(list(spaced))
    return sequences
