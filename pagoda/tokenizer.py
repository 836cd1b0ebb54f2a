"""Tokenizer + chat template; the incremental detokenizer that streams text and finds stop strings."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagoda.errors import InvalidRequest
from pagoda.gguf_layout import check_gguf_layout
from pagoda.gguf_tokenizer import gguf_hf_tokenizer

# Any one of these marks a directory as holding a tokenizer that AutoTokenizer can load.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)

# How many trailing prompt tokens seed the detokenizer window, as vLLM does: enough context
# for a leading-space marker ("▁Hello", "Ġworld") to decode as it would inside the full text.
PROMPT_CONTEXT_TOKENS = 5

# A valid UTF-8 character spans at most 4 bytes, hence at most 4 tokens. If this many tokens
# are pending and the text still ends in U+FFFD, the bytes are invalid and will never resolve:
# release them rather than let the decode window (and its cost per token) grow without bound.
MAX_PENDING_TOKENS = 16

REPLACEMENT_CHAR = "\ufffd"

# A chat template (the model's, the server's, or one a request brings under
# --trust-request-chat-template) renders within this many seconds and characters, or the request
# is refused: the Jinja sandbox bounds what a template may touch, not how long it loops.
CHAT_TEMPLATE_TIME_LIMIT_S = 2.0
CHAT_TEMPLATE_MAX_CHARS = 8 * 1024 * 1024
# Jinja compiles every template to Python code under this file name.
_TEMPLATE_CODE_FILE = "<template>"


class _TemplateDeadline:
    """A trace function for the rendering thread that stops a template's own code (its loops
    and macros, never the library around it) once the deadline passes."""

    CHECK_EVERY = 1024  # line events between clock reads

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.events = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self._in_template if frame.f_code.co_filename == _TEMPLATE_CODE_FILE else None

    def _in_template(self, frame: Any, event: str, arg: Any) -> Any:
        self.events += 1
        if self.events % self.CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise InvalidRequest(f"the chat template did not render within {self.seconds:g} s", param="messages")
        return self._in_template


class Tokenizer:
    """Wraps a Hugging Face fast tokenizer loaded from a local directory.

    Loaded with ``transformers.AutoTokenizer.from_pretrained(path)`` from local files only,
    never the hub.
    """

    def __init__(self, hf: PreTrainedTokenizerBase, encoder: Any | None = None) -> None:
        """`encoder`: a `tokenizers.Tokenizer` that encodes instead of `hf` (a GGUF SentencePiece
        vocabulary whose scores tie: pagoda/gguf_tokenizer.py); `hf` does everything else."""
        if not getattr(hf, "is_fast", False):
            raise ValueError(
                f"{type(hf).__name__} is not a fast (Rust `tokenizers`) tokenizer; pagoda needs a tokenizer.json"
            )
        self.hf = hf
        self.vocab_size: int = len(hf)
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        # Exactly the ids that `decode(skip_special_tokens=True)` drops: every added token flagged
        # special (Llama 3's 250 reserved tokens, Qwen's <|im_start|>), not only the named ones
        # in `hf.all_special_ids`.
        self._skipped_ids: frozenset[int] = frozenset(
            token_id for token_id, added in hf.added_tokens_decoder.items() if added.special
        )
        self.all_special_ids: set[int] = set(hf.all_special_ids) | self._skipped_ids
        self._backend = hf.backend_tokenizer
        self._encoder = encoder
        self._anchor_ids, self._anchor_text = self._find_anchor()

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        directory = Path(path)
        if (
            directory.is_file()
            and directory.suffix == ".gguf"
            or (
                directory.is_dir()
                and not any((directory / n).is_file() for n in TOKENIZER_FILES)
                and any(directory.glob("*.gguf"))
            )
        ):
            return cls._from_gguf(directory)
        if not directory.is_dir():
            raise ValueError(f"tokenizer directory {str(path)!r} does not exist or is not a folder")
        if not any((directory / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer files in {str(path)!r} (expected one of {', '.join(TOKENIZER_FILES)})")
        try:
            # Never the directory's own code: an `auto_map` in config.json or tokenizer_config.json
            # names Python files transformers would import (vLLM CVE-2026-22807).
            hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - transformers and tokenizers raise many types on bad files
            raise ValueError(
                f"could not load the tokenizer in {str(path)!r}: {type(exc).__name__}: {_first_line(exc)}"
            ) from None
        return cls(hf)

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata, rebuilt as llama.cpp reads it
        (pagoda/gguf_tokenizer.py), with the file's chat template."""
        gguf_file = path if path.is_file() else sorted(path.glob("*.gguf"))[0]
        check_gguf_layout(gguf_file)  # before transformers reads its counts and lengths
        try:
            hf, encoder = gguf_hf_tokenizer(gguf_file)
        except Exception as exc:  # a vocabulary the file's metadata cannot describe, whatever the reader raised
            raise ValueError(
                f"could not build a tokenizer from {str(gguf_file)!r} ({type(exc).__name__}: "
                f"{exc}); pass --tokenizer DIR"
            ) from None
        return cls(hf, encoder)

    def __repr__(self) -> str:
        return f"Tokenizer({self.hf.name_or_path!r}, vocab_size={self.vocab_size})"

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary piece, in characters (byte-level pieces spell one byte each)."""
        return max((len(piece) for piece in self.hf.get_vocab()), default=1)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` that costs no encoding, to refuse a prompt far
        over the context before spending seconds on it. A token covers at most
        `max_token_chars` characters (bytes, for byte-level BPE) of normalized text, and Unicode
        normalization (NFC/NFKC composition, e.g. Hangul jamo) shrinks a text at most 3x."""
        return len(text) // (3 * self.max_token_chars)

    # -- ids <-> text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        if self._encoder is not None:
            return list(self._encoder.encode(text, add_special_tokens=add_special_tokens).ids)
        # verbose=False: length limits are the engine's to enforce, not a log line per long prompt.
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._checked_ids(token_ids)
        text = self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(self._checked_ids(token_ids)))

    def decode_token(self, token_id: int) -> str:
        """The text of one token as it reads inside a longer text, for logprob display.

        Decoded after an anchor token, so a SentencePiece "▁Paris" shows as " Paris" (decoding
        it alone strips the space). A lone partial UTF-8 byte shows as U+FFFD.
        """
        (token_id,) = self._checked_ids([token_id])
        if self._anchor_ids:
            with_anchor = self._decode_raw(self._anchor_ids + [token_id], skip_special_tokens=False)
            if with_anchor.startswith(self._anchor_text):
                return with_anchor[len(self._anchor_text) :]
        return self._decode_raw([token_id], skip_special_tokens=False)

    def _decode_raw(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        # The Rust decoder alone: what `hf.decode` does minus Python overhead; the two are equal
        # unless the tokenizer enables clean_up_tokenization_spaces.
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _checked_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = list(token_ids)
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is out of range for a vocabulary of {self.vocab_size}")
        return ids

    def _find_anchor(self) -> tuple[list[int], str]:
        anchor_ids = list(self._backend.encode("a", add_special_tokens=False).ids)
        anchor_text = self._decode_raw(anchor_ids, skip_special_tokens=False)
        if len(anchor_ids) != 1 or anchor_text != "a":
            return [], ""
        return anchor_ids, anchor_text

    # -- chat ---------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text with the model's chat template (or the one given
        as `chat_template=`).

        A message's content may be a string or a list of OpenAI content parts; text parts are
        joined with newlines (as vLLM does); see `normalize_messages`. Bad messages and template
        errors raise InvalidRequest (a ValueError) with param "messages".
        """
        if not (template_kwargs.get("chat_template") or self.has_chat_template):
            raise InvalidRequest(
                f"the tokenizer in {self.hf.name_or_path!r} has no chat template; "
                "use the completions API or supply a model with one",
                param="messages",
            )
        conversation = normalize_messages(messages)
        previous_trace = sys.gettrace()
        sys.settrace(_TemplateDeadline(CHAT_TEMPLATE_TIME_LIMIT_S))
        try:
            rendered = self.hf.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )
        except InvalidRequest:
            raise
        except jinja2.TemplateError as exc:  # a raise_exception() in the template, an unknown include
            raise InvalidRequest(f"chat template error: {_first_line(exc)}", param="messages") from None
        except ValueError as exc:  # transformers' checks of the messages (continue_final_message)
            raise InvalidRequest(f"chat template: {_first_line(exc)}", param="messages") from None
        except (ArithmeticError, LookupError, TypeError, AttributeError, RecursionError, MemoryError) as exc:
            # What a template's own expressions raise ({{ 1/0 }}, range(100001)|list): its fault, not the server's
            raise InvalidRequest(
                f"chat template error: {type(exc).__name__}: {_first_line(exc)}", param="messages"
            ) from None
        finally:
            sys.settrace(previous_trace)
        if not isinstance(rendered, str):
            raise ValueError(f"chat template rendered {type(rendered).__name__}, expected a string")
        if len(rendered) > CHAT_TEMPLATE_MAX_CHARS:
            raise InvalidRequest(
                f"the chat template rendered {len(rendered)} characters; at most {CHAT_TEMPLATE_MAX_CHARS} are taken",
                param="messages",
            )
        return rendered

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        rendered = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        # The template writes BOS itself where the model wants one; adding special tokens again
        # would give Llama 3 two <|begin_of_text|>.
        return self.encode(rendered, add_special_tokens=False)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def normalize_messages(messages: Any, roles: Sequence[str] | None = None) -> list[dict]:
    """Messages as chat templates expect them: dicts with a role and string content.

    The one place messages are checked and normalized (the server's endpoints and `LLM.chat`
    both come through here). Content may be a string or a list of OpenAI content parts; text
    parts are joined with newlines (as vLLM does), other part types are refused. "developer"
    (OpenAI's newer name for the system role) becomes "system"; missing content becomes "".
    `roles`, when given, is the allowed set (before that renaming). Raises InvalidRequest with
    param "messages".
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest(
            "messages must be a non-empty list of {'role': ..., 'content': ...} objects", param="messages"
        )
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{index}] must be an object, got {type(message).__name__}", param="messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{index}].role must be a non-empty string", param="messages")
        if roles is not None and role not in roles:
            raise InvalidRequest(
                f"messages[{index}].role {role!r} is not supported; use one of {', '.join(roles)}.", param="messages"
            )
        copied = dict(message)
        if role == "developer":
            copied["role"] = "system"
        copied["content"] = _content_text(copied.get("content"), index)
        normalized.append(copied)
    return normalized


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise InvalidRequest(
            f"messages[{index}].content must be a string or a list of content parts, got {type(content).__name__}",
            param="messages",
        )
    texts = []
    for part_index, part in enumerate(content):
        where = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, Mapping):
            raise InvalidRequest(
                f"{where} must be a content part object like {{'type': 'text', 'text': ...}}", param="messages"
            )
        if part.get("type") != "text":
            raise InvalidRequest(
                f"{where} has type {part.get('type')!r}; only 'text' content parts are supported", param="messages"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}.text must be a string", param="messages")
        texts.append(text)
    return "\n".join(texts)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, for streaming.

    The vLLM/TGI scheme: decode a small window of tokens (``prefix_offset`` .. end), diff it
    against the already-released part of the window (``prefix_offset`` .. ``read_offset``), and
    release only text that does not end in U+FFFD, i.e. not inside a multi-byte character.

    Stop strings: the stop that completes first (ties: the one starting earlier) wins, whatever
    the token boundaries. When stop strings are cut from the output, the longest tail of the text
    that could still begin a stop string is withheld until it cannot, or until ``finish()``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only slow (Python) tokenizers honour this; for fast ones HF decode ignores it too.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: tuple[str, ...] = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_string: str | None = None

        self._token_ids = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text_len = len(self._decode(0, self._read_offset))

        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Every proper prefix of every stop string: a text tail in this set may still grow
        # into a stop string, so it is withheld (only needed when stops are cut from the output).
        self._stop_prefixes: frozenset[str] = frozenset(s[:k] for s in self.stop for k in range(1, len(s)))
        self._withhold = bool(self.stop) and not include_stop_str_in_output
        self._recent = ""  # last (max stop length - 1) chars decoded, for matches across calls
        self._withheld = ""
        self._released_parts: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        if len(self._released_parts) > 1:
            self._released_parts = ["".join(self._released_parts)]
        return self._released_parts[0] if self._released_parts else ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated tokens; returns the newly released text (may be "")."""
        if self.stop_string is not None:
            raise RuntimeError(f"stop string {self.stop_string!r} already matched; the request is over")
        if self._finished:
            raise RuntimeError("finish() was already called; the request is over")
        decoded = []
        for token_id in token_ids:
            token_id = int(token_id)
            if not self._contributes_text(token_id):
                continue
            self._token_ids.append(token_id)
            decoded.append(self._detokenize_step())
        new_text = "".join(decoded)
        if not new_text:
            return ""
        return self._release(new_text)

    def finish(self) -> str:
        """The request ended without a stop string: release text withheld for a possible stop."""
        if self._finished or self.stop_string is not None:
            self._finished = True
            return ""
        self._finished = True
        tail, self._withheld = self._withheld, ""
        if tail:
            self._released_parts.append(tail)
        return tail

    # -- detokenization -----------------------------------------------------------------------

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(context) == PROMPT_CONTEXT_TOKENS:
                break
            if self._contributes_text(int(token_id)):
                context.append(int(token_id))
        context.reverse()
        return context

    def _contributes_text(self, token_id: int) -> bool:
        # Tokens that decode drops anyway (skipped specials; ids past the tokenizer's vocabulary,
        # which a model with a padded embedding can sample) stay out of the window: it stays small.
        if not 0 <= token_id < self.tokenizer.vocab_size:
            return False
        return not (self.skip_special_tokens and token_id in self.tokenizer._skipped_ids)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer._decode_raw(self._token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _detokenize_step(self) -> str:
        """Text newly completed by the last appended token; advances the window when stable."""
        window_text = self._decode(self._prefix_offset, len(self._token_ids))
        pending = len(self._token_ids) - self._read_offset
        if len(window_text) <= self._prefix_text_len:
            return ""
        if window_text.endswith(REPLACEMENT_CHAR) and pending < MAX_PENDING_TOKENS:
            return ""
        new_text = window_text[self._prefix_text_len :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text_len = len(self._decode(self._prefix_offset, self._read_offset))
        return new_text

    # -- stop strings -------------------------------------------------------------------------

    def _release(self, new_text: str) -> str:
        if not self.stop:
            self._released_parts.append(new_text)
            return new_text
        unreleased = self._withheld + new_text
        match = self._find_stop(new_text)
        if match is not None:
            stop, start, end = match
            # Positions are in `self._recent + new_text`, which ends where `unreleased` ends.
            cut = end if self.include_stop_str_in_output else start
            cut_in_unreleased = max(0, len(unreleased) - (len(self._recent) + len(new_text) - cut))
            released = unreleased[:cut_in_unreleased]
            self.stop_string = stop
            self._withheld = ""
        else:
            hold = self._stop_prefix_suffix_len(unreleased) if self._withhold else 0
            released = unreleased[: len(unreleased) - hold]
            self._withheld = unreleased[len(unreleased) - hold :]
            keep = self._max_stop_len - 1
            self._recent = (self._recent + new_text)[-keep:] if keep else ""
        if released:
            self._released_parts.append(released)
        return released

    def _find_stop(self, new_text: str) -> tuple[str, int, int] | None:
        """The stop string that completes first within `new_text` (ties: earliest start)."""
        search = self._recent + new_text
        old_len = len(self._recent)
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            # Only matches that end inside the new text; earlier ones were checked before.
            start = search.find(stop, max(0, old_len - len(stop) + 1))
            if start == -1:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        return stop, start, end

    def _stop_prefix_suffix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_stop_len - 1), 0, -1):
            if text[-length:] in self._stop_prefixes:
                return length
        return 0
