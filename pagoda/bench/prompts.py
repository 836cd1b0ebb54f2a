"""Text with an exact token count for a given tokenizer.

Prompts are built from the tokenizer's own single-token words (" the", " return", ...) so a run of
N of them is usually exactly N tokens; every piece is then checked with the tokenizer and the tail
adjusted until the whole text has the requested count.

A word is found from the vocabulary's pieces, not from decoding one token alone: SentencePiece
(Llama 2) writes a leading space as "▁" and drops it when a token is decoded on its own, while
byte-level BPE (Llama 3, Qwen2, GPT-2) writes it as "Ġ". Each candidate is then checked in
context ("the" + word must add exactly that one token), which is how words are used in a prompt.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"^ [A-Za-z]{1,12}$")
_SPACE_MARKERS = ("\u2581", "\u0120")  # SentencePiece "▁", byte-level BPE "Ġ"
_ANCHOR = "the"
MAX_ADJUST_ROUNDS = 8


@dataclass
class PromptBuilder:
    """Wraps a Hugging Face tokenizer; `count` is what a server sees (special tokens included)."""

    tokenizer: Any
    words: list[str]
    num_special: int  # tokens the tokenizer adds around any text (e.g. BOS)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> PromptBuilder:
        anchor = tokenizer.encode(_ANCHOR, add_special_tokens=False)
        words = []
        for token_id, text in _space_led_pieces(tokenizer):
            if not _WORD.match(text):
                continue
            in_context = tokenizer.encode(_ANCHOR + text, add_special_tokens=False)
            if in_context == anchor + [token_id]:
                words.append(text)
        if len(words) < 8:
            raise ValueError(
                f"the tokenizer has too few single-token words to build prompts from ({len(words)} found; need 8)"
            )
        num_special = len(tokenizer.encode("hello", add_special_tokens=True)) - len(
            tokenizer.encode("hello", add_special_tokens=False)
        )
        return cls(tokenizer, words, num_special)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def count_content(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def extend_to(self, prefix: str, target: int, rng: random.Random, *, content_only: bool = False) -> str:
        """prefix + random words with exactly `target` tokens (content only or with special tokens).

        The prefix itself is never changed, so texts that share it share its tokens (prefix caching).
        """
        counter = self.count_content if content_only else self.count
        base = counter(prefix) if prefix else (0 if content_only else self.num_special)
        if target < base:
            raise ValueError(f"cannot build a {target}-token text: the fixed part alone has {base} tokens")
        suffix_words = [rng.choice(self.words) for _ in range(target - base)]
        for _ in range(MAX_ADJUST_ROUNDS):
            text = prefix + "".join(suffix_words)
            diff = target - counter(text)
            if diff == 0:
                return text
            if diff > 0:
                suffix_words.extend(rng.choice(self.words) for _ in range(diff))
            else:
                del suffix_words[max(0, len(suffix_words) + diff) :]
        raise ValueError(f"could not reach exactly {target} tokens with this tokenizer")


def _space_led_pieces(tokenizer: Any) -> list[tuple[int, str]]:
    """(token id, text with a real leading space) for every vocabulary piece led by a space marker."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [
        (token_id, " " + piece[1:])
        for token_id, piece in enumerate(pieces)
        if isinstance(piece, str) and piece[:1] in _SPACE_MARKERS
    ]
