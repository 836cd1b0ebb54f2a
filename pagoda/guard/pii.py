"""Detectors for personal data and secrets: emails, phone numbers, payment cards, API keys.

Patterns favour precision over recall (a redacted false positive garbles a client's text):
phone numbers need 10-15 digits in a phone-like layout, card numbers must pass the Luhn check,
API keys must have a known vendor prefix or a long high-entropy-looking token after one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import regex  # the `re` superset with partial matching, to hold back a match still forming

PII_TYPES = ("email", "phone", "credit_card", "api_key")


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    label: str  # what was found: "email", "phone", the rule's name for regex, ...


_EMAIL = regex.compile(
    r"(?<![\w.+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*"
    r"\.[A-Za-z]{2,24}(?![\w-])"
)
# +CC (optional), then groups of digits separated by space, dot, dash or parentheses.
_PHONE = regex.compile(
    r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,4}"
    r"(?:[\s.-]?\d{2,4}){2,4}(?![\w])"
)
_CARD = regex.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")
_API_KEY = regex.compile(
    r"(?<![\w-])(?:"
    r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}"  # OpenAI / Anthropic style
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|gh[pousr]_[A-Za-z0-9]{36,}"  # GitHub tokens
    r"|github_pat_[A-Za-z0-9_]{40,}"
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|AIza[0-9A-Za-z_-]{35}"  # Google API key
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab
    r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face
    r")(?![\w-])"
)


def luhn_valid(digits: str) -> bool:
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char)
        if i % 2 == 1:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _emails(text: str) -> Iterator[Span]:
    for m in _EMAIL.finditer(text):
        yield Span(m.start(), m.end(), "email")


def _cards(text: str) -> Iterator[Span]:
    for m in _CARD.finditer(text):
        digits = re.sub(r"\D", "", m.group())
        if 13 <= len(digits) <= 19 and luhn_valid(digits):
            yield Span(m.start(), m.end(), "credit_card")


def _phones(text: str) -> Iterator[Span]:
    for m in _PHONE.finditer(text):
        digits = re.sub(r"\D", "", m.group())
        if not 10 <= len(digits) <= 15:
            continue
        # A bare run of digits is a phone number only at the length of a national number.
        if m.group().isdigit() and len(digits) > 11:
            continue
        # A Luhn-valid 13+ digit run is a card, not a phone number.
        if len(digits) >= 13 and luhn_valid(digits) and not m.group().startswith("+"):
            continue
        yield Span(m.start(), m.end(), "phone")


def _api_keys(text: str) -> Iterator[Span]:
    for m in _API_KEY.finditer(text):
        yield Span(m.start(), m.end(), "api_key")


DETECTORS: dict[str, Callable[[str], Iterator[Span]]] = {
    "email": _emails,
    "phone": _phones,
    "credit_card": _cards,
    "api_key": _api_keys,
}


PATTERNS = {"email": _EMAIL, "phone": _PHONE, "credit_card": _CARD, "api_key": _API_KEY}


def find_pii(text: str, types: tuple[str, ...] = PII_TYPES) -> list[Span]:
    """Every detected span of the given types, sorted by start."""
    spans = [span for kind in types for span in DETECTORS[kind](text)]
    return sorted(spans, key=lambda s: (s.start, -s.end))


def unfinished_start(pattern: regex.Pattern[str], text: str) -> int | None:
    """Where a match of `pattern` that more text could still extend begins: a partial match
    at the end of `text`, or a complete one that touches the end. None if there is none."""
    for match in pattern.finditer(text, partial=True):
        if match.end() == len(text) and match.start() < len(text):
            return match.start()
    return None
