"""Streamed text: each token's characters once they are whole, and where each token ends in the text.

Decoding the whole output again for every chunk costs O(n) a chunk; here each token costs two decodes of a
short window (vLLM's prefix / read offsets): the text the window's settled tokens make, and the text with the
new ones. A trailing U+FFFD means a character's bytes are split across tokens: those tokens stay pending
until a later token completes the character (or the end). Stop strings (stop_strings.py) need `ends`: the
text length once each token is settled, to cut the tokens where the text is cut.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # the settled tokens' text from offset `start` on (what is before it was trimmed)
        self.start = 0
        self.ends: list[int] = []  # ends[i]: the text's length once token i is settled (one per settled token)
        self._prefix = 0  # the window starts here: tokens before it no longer change the text
        self._read = 0  # tokens before this one are in `text`

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Take the next tokens; returns the text they settle (`final`: the end, nothing held back)."""
        before = self.length
        for index, token in enumerate(token_ids):
            self.token_ids.append(token)
            self._settle(flush=final and index == len(token_ids) - 1)
        if final and not token_ids:
            self._settle(flush=True)
        return self.slice(before, self.length)

    @property
    def length(self) -> int:
        return self.start + len(self.text)

    @property
    def num_settled(self) -> int:
        return len(self.ends)

    def slice(self, begin: int, end: int) -> str:
        """The text between two absolute offsets (not before `start`)."""
        return self.text[begin - self.start : end - self.start]

    def trim(self, keep_from: int) -> None:
        """Forget the text before the absolute offset `keep_from`."""
        if keep_from > self.start:
            self.text, self.start = self.text[keep_from - self.start :], keep_from

    def _settle(self, flush: bool) -> None:
        ids = self.token_ids
        settled = self._decode(ids[self._prefix : self._read])
        window = self._decode(ids[self._prefix :])
        if window.endswith(REPLACEMENT) and not flush:
            return  # a character still incomplete: its tokens wait
        if len(window) > len(settled):
            self.text += window[len(settled) :]
            self._prefix, self._read = self._read, len(ids)
        self.ends += [self.length] * (len(ids) - len(self.ends))  # text-less tokens (skipped special ones) too

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
