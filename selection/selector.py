"""The selection entry points: `select_backends`, a pure function of its request, and `Selector`, the same
behind a cache. The rules they apply (R1 to R8 and R11; R9 and R10 apply at run time) are gathered in rules.py and
defined in docs/selection.md.

`Selector`'s cache is keyed by the parsed request: bounded (its strings are checked against bounds.py first) and
only what selection reads (not the device's name or memory), so that neither a caller's large fields nor
requests differing only in those fill it. A request that fails its checks is refused before the cache. The
selector service serves it; the executor calls the same code in-process.
"""

from __future__ import annotations

import functools

from selection.request import ParsedRequest, parse_request
from selection.rules import decide_stacks
from specdec.v1 import selector_pb2
from specdec_runtime.errors import SpecdecError


def select_backends(request: selector_pb2.SelectBackendsRequest) -> selector_pb2.SelectBackendsResponse:
    """Decide the target's and the drafter's backends (uncached)."""
    return decide_stacks(parse_request(request))


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
        return decide_stacks(parsed)
    except SpecdecError as err:  # cached too: the same request always fails the same way
        return err.with_traceback(None)
