"""Keeping training text apart from held-out text, and duplicates out of training.

The split by source key (prompts.py) keeps a passage or function on one side, but the same text can
come back under another key: a vendored copy of a stdlib function in a package, a verse quoted in a
manual, a different Python version's line numbers. So a training candidate is also refused when its
text shares a run of words with any held-out prompt, or when it asks for a held-out function by its
signature and summary; and a candidate whose normalized text was already taken is a duplicate.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

SHINGLE_WORDS = 12  # a shared run of this many words (plus the stride) counts as shared text
STRIDE = 4  # candidate shingles checked: every STRIDE-th, so any shared run of 15 words is found
WRITE_REQUEST = re.compile(r"^Write a Python (?:function|method) `(.+)`\. What it does: (.+)$", re.S)
WORD = re.compile(r"\w+")


def normalized_hash(text: str) -> bytes:
    """Equal for texts that differ only in case and whitespace."""
    return hashlib.blake2b(" ".join(text.lower().split()).encode(), digest_size=12).digest()


def function_request(signature: str, summary: str) -> bytes:
    return normalized_hash(f"{signature}\n{summary}")


class HeldOutGuard:
    """Built from the held-out prompts; `shares` says whether a training candidate touches any of them."""

    def __init__(self, held_out: Iterable[tuple[str, str]]) -> None:
        """`held_out`: (source key, prompt text) pairs."""
        self.sources: set[str] = set()
        self.shingles: set[int] = set()
        self.requests: set[bytes] = set()
        for source, text in held_out:
            self.sources.add(source)
            words = WORD.findall(text.lower())
            self.shingles.update(_shingle(words, i) for i in range(len(words) - SHINGLE_WORDS + 1))
            match = WRITE_REQUEST.match(text)
            if match:
                self.requests.add(function_request(match[1], match[2]))

    def shares(self, source: str, text: str, request: bytes | None = None) -> bool:
        """True when the candidate (its key, its whole material, and for a function its request) meets
        held-out text."""
        if source in self.sources or (request is not None and request in self.requests):
            return True
        words = WORD.findall(text.lower())
        last = len(words) - SHINGLE_WORDS
        starts = [*range(0, last + 1, STRIDE), *([last] if last > 0 else [])]
        return any(_shingle(words, i) in self.shingles for i in starts)


def _shingle(words: list[str], start: int) -> int:
    return hash(" ".join(words[start : start + SHINGLE_WORDS]))
