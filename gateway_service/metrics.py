"""The gateway's Prometheus metrics, served at GET /metrics on its own HTTP port: requests by route and status,
their latency, time to first token, tokens, open generations and callers that went away mid-generation.

With --workers N, every worker process records into files of its own in one directory (prometheus_client's
multiprocess mode: the supervisor sets PROMETHEUS_MULTIPROC_DIR before it starts them), and whichever worker
answers GET /metrics adds up every worker's files: counters and histograms over every worker that has run, open
generations over the workers alive."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.responses import Response

from specdec_runtime.observability import LATENCY_BUCKETS

ROUTES = ("chat", "completion", "models", "model", "health", "metrics")


def workers_registry(directory: str) -> CollectorRegistry:
    """A registry that reads every worker's metrics from their multiprocess directory."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, directory)
    return registry


class GatewayMetrics:
    """`multiprocess_dir`: this process is one of --workers, whose metrics live there (PROMETHEUS_MULTIPROC_DIR,
    set before prometheus_client was imported); /metrics then shows every worker's."""

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "specdec_gateway_requests", "HTTP requests answered, by route and status", ["route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "specdec_gateway_request_seconds", "Time from a request's arrival to its last byte", ["route"],
            registry=self.registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.first_token = Histogram(
            "specdec_gateway_time_to_first_token_seconds", "Time from a generation's arrival to its first token",
            ["route"], registry=self.registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.tokens = Counter(
            "specdec_gateway_tokens", "Prompt and completion tokens of finished generations", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.open = Gauge(
            "specdec_gateway_open_generations", "Generations in flight", registry=self.registry,
            multiprocess_mode="livesum",  # with workers: the sum over the live ones
        )  # fmt: skip
        self.disconnects = Counter(
            "specdec_gateway_client_disconnects",
            "Generations whose caller went away before the end (the executor's request was aborted)",
            registry=self.registry,
        )

        self.exposed = workers_registry(multiprocess_dir) if multiprocess_dir else self.registry
        self._answered: dict[tuple[str, int], Any] = {}
        self._latency = {route: self.latency.labels(route) for route in ROUTES}
        self._first_token = {route: self.first_token.labels(route) for route in ROUTES}
        self.prompt_tokens, self.completion_tokens = self.tokens.labels("prompt"), self.tokens.labels("completion")

    def answered(self, route: str, status: int, seconds: float) -> None:
        """One request answered: its status and latency (each label set's child looked up once, not per request:
        prometheus_client's labels() validates and locks on every call)."""
        counter = self._answered.get((route, status))
        if counter is None:
            counter = self._answered[route, status] = self.requests.labels(route, str(status))
        counter.inc()
        self._latency[route].observe(seconds)

    def first_token_after(self, route: str, seconds: float) -> None:
        self._first_token[route].observe(seconds)

    def response(self) -> Response:
        return Response(generate_latest(self.exposed), media_type=CONTENT_TYPE_LATEST)
