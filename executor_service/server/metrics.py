"""The executor's Prometheus metrics, next to the RPC metrics in the same registry: tokens (and tokens/s
over a sliding window), queue depth, running requests, KV blocks used, step latency, and speculative
decoding's drafted / accepted tokens, per draft position and as a mean acceptance length, the k adaptive
speculation chooses per step, and the prefix cache's lookups, hits and hit rate."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from executor_service.engine.prefix_cache import PrefixCacheStats

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 10)
WINDOW_SECONDS = 10.0


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.generated = Counter("specdec_generated_tokens", "Tokens generated (sampled)", registry=registry)
        self.computed = Counter("specdec_computed_tokens", "Tokens run through the target model", registry=registry)
        self.step_latency = Histogram(
            "specdec_step_latency_seconds",
            "One engine step: schedule, forward, sample",
            registry=registry,
            buckets=STEP_BUCKETS,
        )
        self.tokens_per_second = Gauge(
            "specdec_generation_tokens_per_second",
            f"Generated tokens/s over the last {WINDOW_SECONDS:.0f} s",
            registry=registry,
        )
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for admission", registry=registry)
        self.running = Gauge("specdec_running_requests", "Requests in the running batch", registry=registry)
        self.kv_used = Gauge("specdec_kv_blocks_used", "KV cache blocks held by requests", registry=registry)
        self.kv_total = Gauge("specdec_kv_blocks_total", "KV cache blocks in all", registry=registry)
        self.drafted = Counter("specdec_draft_tokens", "Drafted tokens verified by the target", registry=registry)
        self.accepted = Counter("specdec_accepted_tokens", "Drafted tokens the target accepted", registry=registry)
        self.verify_steps = Counter(
            "specdec_verify_steps",
            "Request-steps that verified drafts (per request per target step)",
            registry=registry,
        )
        self.position_drafted = Counter(
            "specdec_position_drafted_tokens", "Drafts verified per draft position", ["position"], registry=registry
        )
        self.position_accepted = Counter(
            "specdec_position_accepted_tokens",
            "Drafts accepted at each draft position",
            ["position"],
            registry=registry,
        )
        self.mean_acceptance_length = Gauge(
            "specdec_mean_acceptance_length",
            "Tokens emitted per verify step since start (accepted drafts + 1)",
            registry=registry,
        )
        self.mean_acceptance_length.set_function(self._acceptance_length)
        since_load = "since the model was loaded"
        self.prefix_cache_queries = Gauge(
            "specdec_prefix_cache_queries",
            f"Prompt tokens looked up in the prefix cache {since_load}",
            registry=registry,
        )
        self.prefix_cache_hits = Gauge(
            "specdec_prefix_cache_hits",
            f"Prompt tokens whose K/V came from the prefix cache {since_load}",
            registry=registry,
        )
        self.prefix_cache_hit_rate = Gauge(
            "specdec_prefix_cache_hit_rate", f"Prefix cache hits / queries {since_load}", registry=registry
        )
        self.cached_free_blocks = Gauge(
            "specdec_kv_blocks_cached_free", "Free KV blocks still holding reusable prefixes", registry=registry
        )
        self.speculative_k = Gauge(
            "specdec_speculative_k",
            "Drafts per request chosen for the latest step (adaptive speculation)",
            registry=registry,
        )
        self.speculative_k_steps = Counter(
            "specdec_speculative_k_steps",
            "Steps planned at each k (0: no drafting; adaptive speculation)",
            ["k"],
            registry=registry,
        )
        self._verify_totals = [0, 0]  # verify steps, accepted drafts: what the gauge divides
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self.tokens_per_second.set_function(self._rate)

    def on_step(self, computed: int, generated: int, seconds: float) -> None:
        """Called by the engine thread after each step."""
        self.computed.inc(computed)
        self.generated.inc(generated)
        self.step_latency.observe(seconds)
        now = time.monotonic()
        with self._lock:
            self._window.append((now, generated))
            while self._window and self._window[0][0] < now - WINDOW_SECONDS:
                self._window.popleft()

    def on_verify(self, drafted: list[int], accepted: list[int]) -> None:
        """Called by the engine thread after a step that verified drafts: per request, drafts and accepted."""
        for num_drafts, num_accepted in zip(drafted, accepted, strict=True):
            if not num_drafts:
                continue
            self.verify_steps.inc()
            self.drafted.inc(num_drafts)
            self.accepted.inc(num_accepted)
            with self._lock:
                self._verify_totals[0] += 1
                self._verify_totals[1] += num_accepted
            for position in range(num_drafts):
                self.position_drafted.labels(str(position)).inc()
                if position < num_accepted:
                    self.position_accepted.labels(str(position)).inc()

    def on_plan(self, k: int) -> None:
        """Called by the engine thread for each step's k chosen by adaptive speculation (adaptive_k.py)."""
        self.speculative_k.set(k)
        self.speculative_k_steps.labels(str(k)).inc()

    def _acceptance_length(self) -> float:
        with self._lock:
            steps, accepted = self._verify_totals
        return 1.0 + accepted / steps if steps else 0.0

    def watch(
        self,
        queue_depth: Callable[[], float],
        running: Callable[[], float],
        kv_used: Callable[[], float],
        kv_total: Callable[[], float],
    ) -> None:
        """Read the gauges from the current session at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)
        self.kv_used.set_function(kv_used)
        self.kv_total.set_function(kv_total)

    def watch_prefix_cache(self, stats: Callable[[], PrefixCacheStats]) -> None:
        """Read the prefix cache's counts from the current session at scrape time."""
        self.prefix_cache_queries.set_function(lambda: stats().queries)
        self.prefix_cache_hits.set_function(lambda: stats().hits)
        self.prefix_cache_hit_rate.set_function(lambda: stats().hit_rate)
        self.cached_free_blocks.set_function(lambda: stats().cached_free_blocks)

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._window if t >= now - WINDOW_SECONDS]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span
