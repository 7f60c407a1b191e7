"""The engine's own errors, in the engine's words: plain exceptions that name no status code and no proto.

The engine, sampling, speculative decoding and the model runner raise these (or hand them to a request's
output); the server maps each kind to its gRPC status once, at its edge (`wire.status_error`). An error about
one field of a request names that field's path (e.g. "sampling.max_tokens"), so the status can carry it as a
field violation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldProblem:
    """One bad field of a request: its dotted path (e.g. "target.path") and what is wrong with it; the server
    turns it into a status's field violation (clipped there, as every status text is)."""

    field: str
    description: str


class EngineError(Exception):
    """A failure the engine reports rather than a bug; `field` and `description`: the request field it is about
    (or None) and what is wrong with it."""

    def __init__(self, message: str, field: str | None = None, description: str = "") -> None:
        super().__init__(message)
        self.message, self.field, self.description = message, field, description

    @property
    def problems(self) -> tuple[FieldProblem, ...]:
        """The request fields this error is about (a status's field violations)."""
        return (FieldProblem(self.field, self.description),) if self.field is not None else ()


class RequestFieldError(EngineError):
    """Request fields found wrong, every one at once (a LoadModel's paths, files and sizes, a chat's messages).
    `summarized`: the message is the summary of the problems ("invalid request: field: what; ..."), which the
    server rebuilds from the clipped violations."""

    def __init__(self, message: str, problems: Iterable[FieldProblem] = (), summarized: bool = False) -> None:
        found = tuple(problems)
        first = found[0] if found else None
        super().__init__(message, first.field if first else None, first.description if first else "")
        self._problems, self.summarized = found, summarized

    @property
    def problems(self) -> tuple[FieldProblem, ...]:
        return self._problems


class InvalidField(RequestFieldError):
    """A field's value is wrong (INVALID_ARGUMENT): a bad path, an unreadable or malformed file, bad sizes."""


class UnmetPrecondition(RequestFieldError):
    """A field asks for what this executor cannot do as it is (FAILED_PRECONDITION): a package not installed,
    a tokenizer without a chat template."""


def invalid_fields(problems: Iterable[FieldProblem]) -> InvalidField:
    """One InvalidField for every bad field found, so callers fix them all in one round trip."""
    found = tuple(problems)
    summary = "; ".join(f"{p.field}: {p.description}" for p in found)
    return InvalidField(f"invalid request: {summary}", found, summarized=True)


class OutOfKVCache(EngineError):
    """The KV cache, or the memory for it, cannot hold what is asked (RESOURCE_EXHAUSTED)."""


class KVCacheFull(OutOfKVCache):
    """More blocks asked than are free (the scheduler asks only for what it checked is there)."""


class RequestTooLarge(OutOfKVCache):
    """A request that no amount of preemption lets grow: it needs more KV slots than the whole cache holds."""


class NoRoomForKVCache(OutOfKVCache):
    """The memory left after the weights holds no KV block."""


class EngineUnavailable(EngineError):
    """No step can run again until the server is restarted (UNAVAILABLE): a tensor-parallel rank is gone."""
