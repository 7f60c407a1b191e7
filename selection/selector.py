"""Backend selection (rules R2-R6): explicit names are validated and used or refused, auto walks the
platform's priority list, and the drafter is decided on its own needs, never inherited.
The rules R1-R10, and where each is applied: docs/selection.md.

`select_backends` is a pure function of its request; `Selector` adds a cache keyed by the parsed request:
bounded (its strings are checked against bounds.py first) and only what selection reads (not the device's
name or memory), so that neither a caller's large fields nor requests differing only in those fill it. A
request that fails its checks is refused before the cache. The executor calls the same code in-process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kernels.capabilities import BACKENDS, AttentionNeeds, Hardware, Platform
from selection.registry import priority_list
from selection.request import ParsedRequest, StackRequest, parse_request
from specdec.v1 import common_pb2, selector_pb2
from specdec_runtime.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    PreconditionViolation,
    SpecdecError,
)


@dataclass(frozen=True)
class Decision:
    backend: str
    explicit: bool
    use_non_causal: bool
    candidates: tuple[tuple[str, tuple[str, ...]], ...]  # (backend, reasons), in priority order

    def to_proto(self) -> common_pb2.BackendDecision:
        return common_pb2.BackendDecision(
            backend=self.backend,
            explicit=self.explicit,
            use_non_causal=self.use_non_causal,
            candidates=[
                common_pb2.CandidateVerdict(backend=name, reasons=reasons) for name, reasons in self.candidates
            ],
        )


def decide(hardware: Hardware, stack: StackRequest) -> Decision:
    """The backend for one attention stack, or an error that says why there is none."""
    needs = stack.needs
    if stack.backend is not None:  # R2: validated and used, never a silent fallback
        reasons = tuple(BACKENDS[stack.backend].validate(needs, hardware))
        if reasons:
            message = f"Selected backend {stack.backend} is not valid for this configuration. Reason: {list(reasons)}"
            violation = FieldViolation(
                stack.backend_field, f"{stack.backend} cannot serve the {stack.role}: {list(reasons)}"
            )
            raise InvalidArgument(message, field_violations=(violation,))
        return Decision(stack.backend, True, needs.use_non_causal, ((stack.backend, ()),))
    # R3: every candidate is validated and reported; the first valid one wins.
    candidates = tuple(
        (name, tuple(BACKENDS[name].validate(needs, hardware)))
        for name in priority_list(hardware, needs.use_non_causal)
    )
    for name, reasons in candidates:
        if not reasons:
            return Decision(name, False, needs.use_non_causal, candidates)
    rendered = ", ".join(f"{name}: [{', '.join(reasons)}]" for name, reasons in candidates)
    raise FailedPrecondition(
        f"No valid attention backend found for {describe_device(hardware)} with {describe_needs(stack.role, needs)}. "
        f"Reasons: {{{rendered}}}.",
        precondition_violations=tuple(
            PreconditionViolation("BACKEND", name, "; ".join(reasons)) for name, reasons in candidates
        ),
    )


def select_backends(request: selector_pb2.SelectBackendsRequest) -> selector_pb2.SelectBackendsResponse:
    """Decide the target's and the drafter's backends (uncached)."""
    return select_parsed(parse_request(request))


def select_parsed(parsed: ParsedRequest) -> selector_pb2.SelectBackendsResponse:
    """Decide the backends of a checked request."""
    response = selector_pb2.SelectBackendsResponse(target=decide(parsed.hardware, parsed.target).to_proto())
    if parsed.drafter is not None:  # R5: decided on the drafter's own needs and name
        response.drafter.CopyFrom(decide(parsed.hardware, parsed.drafter).to_proto())
    return response


DEFAULT_CACHE_SIZE = 1024


class Selector:
    """select_backends behind an LRU cache of at most `cache_size` entries, keyed by the parsed request
    (selection is a pure function of it). The entries are bounded too: a key holds bounded strings, and a
    response or error names only known backends, reasons and the request's bounded fields."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if cache_size < 0:
            raise ValueError(f"the cache size must be >= 0, not {cache_size}")
        self._cached = functools.lru_cache(maxsize=cache_size)(_select_cached)

    def select(self, request: selector_pb2.SelectBackendsRequest) -> selector_pb2.SelectBackendsResponse:
        """A fresh response (the caller may change it); raises SpecdecError on bad input or no backend."""
        outcome = self._cached(parse_request(request))  # bad input raises here, before the cache
        if isinstance(outcome, SpecdecError):
            raise outcome.fresh()
        response = selector_pb2.SelectBackendsResponse()
        response.CopyFrom(outcome)
        return response

    def cache_info(self) -> functools._CacheInfo:
        return self._cached.cache_info()


def _select_cached(parsed: ParsedRequest) -> selector_pb2.SelectBackendsResponse | SpecdecError:
    try:
        return select_parsed(parsed)
    except SpecdecError as err:  # cached too: the same request always fails the same way
        return err.with_traceback(None)


def describe_device(hardware: Hardware) -> str:
    if hardware.platform is Platform.CUDA:
        major, minor = hardware.compute_capability
        return f"cuda (compute capability {major}.{minor})"
    if hardware.platform is Platform.ROCM:
        return f"rocm ({hardware.gcn_arch})"
    return "cpu"


def describe_needs(role: str, needs: AttentionNeeds) -> str:
    block = needs.block_size if needs.block_size is not None else "auto"
    return (
        f"AttentionSelectorConfig(role={role}, head_size={needs.head_size}, dtype={needs.dtype.value}, "
        f"kv_cache_dtype={needs.kv_cache_dtype}, block_size={block}, use_mla={needs.use_mla}, "
        f"has_sink={needs.has_sink}, has_sliding_window={needs.has_sliding_window}, "
        f"use_non_causal={needs.use_non_causal})"
    )
