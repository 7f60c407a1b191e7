"""The engine's own errors, in the engine's words: plain exceptions that name no status code and no proto.

The engine, sampling, speculative decoding and the model runner raise these (or hand them to a request's
output); the server maps each kind to its gRPC status once, at its edge (`wire.status_error`). An error about
one field of a request names that field's path (e.g. "sampling.max_tokens"), so the status can carry it as a
field violation.
"""

from __future__ import annotations


class EngineError(Exception):
    """A failure the engine reports rather than a bug; `field` and `description`: the request field it is about
    (or None) and what is wrong with it."""

    def __init__(self, message: str, field: str | None = None, description: str = "") -> None:
        super().__init__(message)
        self.message, self.field, self.description = message, field, description


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
