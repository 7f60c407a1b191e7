"""Calls on an in-process executor over gRPC: a collected Generate stream, and its Prometheus metrics scraped
(imported as `grpc_calls`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio

from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2


async def generate(stub, request_id: str, ids: list[int], **sampling) -> list[executor_pb2.GenerateResponse]:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=ids),
        sampling=executor_pb2.SamplingParams(**sampling),
    )
    return [response async for response in stub.Generate(request)]


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(executor: RunningExecutor) -> Samples:
    """Every sample of the executor's /metrics, by name and labels."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{executor.server.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 for a labelled sample not yet created (a missing unlabelled one is an error)."""
    key = (name, frozenset(labels.items()))
    return samples[key] if not labels else samples.get(key, 0.0)
