"""GetServerInfo and GetLoads: what a router or an operator asks once (versions, device, backends, limits,
uptime), and what a router or an autoscaler polls (running and queued requests, KV-cache use, tokens/s over
the last minute, totals, prefix-cache hits).

The counters are fed by the engine thread (`on_step`) and by admission (`on_admit`); the answers read the
engine's own counts without waiting on it (a length of a list, an integer: no lock the engine holds).
"""

from __future__ import annotations

import collections
import importlib.metadata
import math
import threading
import time
from typing import Protocol

import grpc
import torch

from executor_service.server.session import ModelSession
from specdec.v1 import common_pb2, executor_pb2

WINDOW_SECONDS = 60  # generation_tokens_per_second: over the last minute


def server_version() -> str:
    """specdec's installed version (pyproject.toml's, through the package metadata)."""
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+source"


class PrefixCacheCounts(Protocol):
    queries: int
    hits: int
    cached_free_blocks: int


class LoadCounters:
    """Token totals since start and generated tokens per second over the last WINDOW_SECONDS (one bucket a
    second: a poll costs at most WINDOW_SECONDS additions whatever the step rate)."""

    def __init__(self) -> None:
        self.started_monotonic = time.monotonic()
        self.started_unix_ms = int(time.time() * 1000)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._buckets: collections.deque[list[int]] = collections.deque()  # [second, tokens generated]
        self._lock = threading.Lock()

    def on_step(self, computed: int, generated: int, seconds: float) -> None:
        """The engine's step observer (engine thread)."""
        second = math.floor(time.monotonic())
        with self._lock:
            self.generation_tokens += generated
            if self._buckets and self._buckets[-1][0] == second:
                self._buckets[-1][1] += generated
            else:
                self._buckets.append([second, generated])
            self._expire(second)

    def on_admit(self, prompt_tokens: int) -> None:
        """A request was admitted with this many prompt tokens (event loop)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def uptime(self) -> float:
        return time.monotonic() - self.started_monotonic

    def tokens_per_second(self) -> float:
        """Generated tokens over the last minute (or since start, if sooner) per second."""
        now = time.monotonic()
        with self._lock:
            self._expire(math.floor(now))
            tokens = sum(count for _, count in self._buckets)
        span = min(float(WINDOW_SECONDS), now - self.started_monotonic)
        return tokens / span if span > 0 else 0.0

    def _expire(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - WINDOW_SECONDS:
            self._buckets.popleft()


def server_info(
    counters: LoadCounters,
    capabilities: common_pb2.HardwareCapabilities,
    session: ModelSession | None,
    max_batch_size: int,
    max_queued_requests: int,
) -> executor_pb2.GetServerInfoResponse:
    response = executor_pb2.GetServerInfoResponse(
        server_version=server_version(),
        torch_version=torch.__version__,
        grpc_version=grpc.__version__,
        capabilities=capabilities,
        model_loaded=session is not None,
        max_batch_size=max_batch_size,
        max_queued_requests=max_queued_requests,
        uptime_seconds=counters.uptime(),
        started_unix_ms=counters.started_unix_ms,
    )
    if session is not None:
        response.info.CopyFrom(session.info)
        response.target_backend.CopyFrom(session.decision)
        if session.draft_decision is not None:
            response.draft_backend.CopyFrom(session.draft_decision)
        response.max_prompt_tokens = session.limits.max_model_len - 1  # one position left to generate into
    return response


def loads(
    counters: LoadCounters, session: ModelSession | None, prefix_cache: PrefixCacheCounts | None
) -> executor_pb2.GetLoadsResponse:
    response = executor_pb2.GetLoadsResponse(
        generation_tokens_per_second=counters.tokens_per_second(),
        prompt_tokens_total=counters.prompt_tokens,
        generation_tokens_total=counters.generation_tokens,
    )
    if session is not None:
        running = len(session.engine.scheduler.running)
        total, used = session.kv_cache.num_blocks, session.kv_cache.allocator.num_used
        response.running_requests = running
        response.queued_requests = max(session.engine.num_live - running, 0)  # waiting, or not yet scheduled
        response.num_kv_blocks, response.used_kv_blocks = total, used
        response.kv_cache_usage = used / total if total else 0.0
    if prefix_cache is not None:
        response.prefix_cache_queries, response.prefix_cache_hits = prefix_cache.queries, prefix_cache.hits
        response.prefix_cache_hit_rate = prefix_cache.hits / prefix_cache.queries if prefix_cache.queries else 0.0
        response.cached_free_kv_blocks = prefix_cache.cached_free_blocks
    return response
