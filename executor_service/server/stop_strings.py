"""Stop strings: what of a request's output may be streamed, and where it ends.

The engine emits tokens in runs (a verify step emits its accepted drafts and the target's token at once), and
a stop string may end anywhere in a run or span several tokens. The servicer passes each chunk through a
StreamedOutput, which detokenizes it, finds the first stop string, and releases only what is decided:

- text up to the stop string (never the stop string or anything past it), and no text that could still turn
  out to be the start of one (it is held back until a later token decides, or the end);
- the tokens whose characters end at or before the released text's end: the token in which a stop string
  starts, and every token after it, are never streamed (docs/api.md, "Stop strings").

Without stop strings, tokens go out as they come and the text as it settles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from executor_service.models.detokenizer import IncrementalDetokenizer
from specdec_runtime.errors import FieldViolation

MAX_STOP_STRINGS = 16  # SamplingParams.stop entries
MAX_STOP_STRING_CHARS = 256  # characters per stop string


@dataclass(frozen=True)
class Released:
    """What may be streamed now: the next tokens, what came with each (log probabilities), their text."""

    token_ids: list[int]
    extras: list[Any]
    text: str


class StreamedOutput:
    def __init__(self, tokenizer: Any | None, stop: Sequence[str] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = tuple(s for s in stop if s)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.num_tokens = 0  # tokens received
        self.sent_tokens = 0
        self._held: list[int] = []  # tokens received, not yet released
        self._held_extras: list[Any] = []
        self.sent_chars = 0
        self.searched = 0  # the text before this offset was searched for stop strings
        self.stop_at: int | None = None  # where the first stop string starts in the text, once found

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    def add(self, token_ids: list[int], final: bool, extras: Sequence[Any] | None = None) -> Released:
        """Take the next tokens, and what comes with each (`extras`, released with it); `final`: the request has
        finished. Returns what may be streamed now."""
        self.num_tokens += len(token_ids)
        if not self.stopped:
            self._held += token_ids
            self._held_extras += extras if extras is not None else [None] * len(token_ids)
        detok = self.detokenizer
        if self.stopped or detok is None:  # past a stop string nothing more is streamed
            return self._release(self.sent_tokens if self.stopped else self.num_tokens, self.sent_chars)
        detok.add(token_ids, final)
        if not self.stop:  # tokens need not wait for their text
            return self._release(self.num_tokens, detok.length)
        searched_from = max(self.searched - self.longest + 1, detok.start)
        found = check_stop_strings(detok.slice(searched_from, detok.length), self.stop)
        self.searched = detok.length
        if found is not None:
            self.stop_at = limit = searched_from + found
        elif final:
            limit = detok.length
        else:
            tail_from = max(detok.length - self.longest + 1, detok.start)
            limit = tail_from + held_back_from(detok.slice(tail_from, detok.length), self.stop)
        tokens = self.sent_tokens
        while tokens < detok.num_settled and detok.ends[tokens] <= limit:
            tokens += 1
        released = self._release(self.num_tokens if final and found is None else tokens, limit)
        detok.trim(min(self.sent_chars, max(self.searched - self.longest + 1, 0)))
        return released

    def _release(self, tokens: int, chars: int) -> Released:
        detok = self.detokenizer
        text = detok.slice(self.sent_chars, chars) if detok is not None and chars > self.sent_chars else ""
        count = max(tokens - self.sent_tokens, 0)
        released = Released(self._held[:count], self._held_extras[:count], text)
        del self._held[:count], self._held_extras[:count]
        if self.stopped:  # the tokens from the one where the stop string starts: never streamed
            self._held.clear()
            self._held_extras.clear()
        self.sent_tokens, self.sent_chars = self.sent_tokens + count, max(chars, self.sent_chars)
        return released


def stop_violations(stop: Sequence[str]) -> list[FieldViolation]:
    """SamplingParams.stop: at most MAX_STOP_STRINGS, each 1 to MAX_STOP_STRING_CHARS characters."""
    if len(stop) > MAX_STOP_STRINGS:
        return [FieldViolation("sampling.stop", f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")]
    found = []
    for index, string in enumerate(stop):
        if not string:
            found.append(FieldViolation(f"sampling.stop[{index}]", "empty; a stop string has at least 1 character"))
        elif len(string) > MAX_STOP_STRING_CHARS:
            why = f"{len(string)} characters; at most {MAX_STOP_STRING_CHARS}"
            found.append(FieldViolation(f"sampling.stop[{index}]", why))
    return found


def check_stop_strings(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = None
    for string in stop:
        at = text.find(string)
        if at != -1 and (found is None or at < found):
            found = at
    return found


def held_back_from(text: str, stop: Sequence[str]) -> int:
    """Where the text that could still become a stop string starts: the earliest suffix of `text` that is a
    proper prefix of a stop string (len(text) if none). `text` holds no whole stop string."""
    held = len(text)
    for string in stop:
        at = text.find(string[0], max(0, len(text) - len(string) + 1))
        while at != -1 and at < held:
            if string.startswith(text[at:]):
                held = at
                break
            at = text.find(string[0], at + 1)
    return held
