"""Text with an exact token count for a given tokenizer.

Prompts are built from the tokenizer's own single-token words (" the", " return", ...) so a run of
N of them is usually exactly N tokens; every piece is then checked with the tokenizer and the tail
adjusted until the whole text has the requested count.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

_WORD = re.compile(r"^ [A-Za-z]{1,12}$")
MAX_ADJUST_ROUNDS = 8


@dataclass
class PromptBuilder:
    """Wraps a Hugging Face tokenizer; `count` is what a server sees (special tokens included)."""

    tokenizer: Any
    words: list[str]
    num_special: int  # tokens the tokenizer adds around any text (e.g. BOS)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "PromptBuilder":
        words = []
        for token_id in range(len(tokenizer)):
            text = tokenizer.decode([token_id])
            if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        if len(words) < 8:
            raise ValueError("the tokenizer has too few single-token words to build prompts from")
        num_special = len(tokenizer.encode("hello", add_special_tokens=True)) - len(
            tokenizer.encode("hello", add_special_tokens=False))
        return cls(tokenizer, words, num_special)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=True))

    def count_content(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def random_words(self, n: int, rng: random.Random) -> str:
        return "".join(rng.choice(self.words) for _ in range(n))

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
                del suffix_words[max(0, len(suffix_words) + diff):]
        raise ValueError(f"could not reach exactly {target} tokens with this tokenizer")
