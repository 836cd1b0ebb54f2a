"""Prompt-lookup proposals: if the context's last n tokens occurred earlier, propose the
tokens that followed that occurrence. Costs no model forward at all."""

from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the most recent earlier occurrence of the
        longest matching suffix (ngram_max down to ngram_min); [] if none matches."""
        length = len(token_ids)
        haystack = array("q", token_ids).tobytes()
        width = array("q").itemsize
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            needle = haystack[(length - n) * width :]
            # The occurrence must end before the last token so something follows it.
            end = (length - 1) * width
            while True:
                found = haystack.rfind(needle, 0, end)
                if found < 0:
                    break
                if found % width == 0:
                    start = found // width + n
                    return token_ids[start : start + num_tokens]
                end = found + len(needle) - 1  # a match straddling token boundaries: look earlier
        return []
