"""Streamed text: each chunk's new characters, never half a multi-byte character."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes the whole output so far and emits what is new. A trailing U+FFFD means a character's
    bytes are split across tokens: it is held back until the next token completes it (or the end)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.sent = 0

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not final and text.endswith(REPLACEMENT):
            text = text.rstrip(REPLACEMENT)
        new = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return new
