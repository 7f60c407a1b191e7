"""Hostile sizes against a real selector server: every string field is bounded (INVALID_ARGUMENT naming the
field, whatever its size under the message limit; RESOURCE_EXHAUSTED above it), errors that echo input stay
small enough to reach the client, and neither the results cache nor the log keeps what a caller sent."""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from builders import dflash, request
from grpc_status import rpc_status
from rpc_details import field_violations

from selection.selector import Selector
from selector_service.main import start_selector
from specdec.v1 import selector_pb2, selector_pb2_grpc
from specdec_runtime.errors import FieldViolation, InvalidArgument, invalid_fields
from specdec_runtime.grpc_runtime import RunningServer, ServerSettings, create_server, start_server

SERVICE = "specdec.v1.BackendSelector"
KiB = 1024
Mutation = Callable[[selector_pb2.SelectBackendsRequest, str], None]


def _set(path: str) -> Mutation:
    def mutate(req: selector_pb2.SelectBackendsRequest, value: str) -> None:
        *parents, leaf = path.split(".")
        message = req
        for name in parents:
            message = getattr(message, name)
        setattr(message, leaf, value)

    return mutate


def _library_name(req: selector_pb2.SelectBackendsRequest, value: str) -> None:
    req.hardware.libraries[0].name = value


def _library_version(req: selector_pb2.SelectBackendsRequest, value: str) -> None:
    req.hardware.libraries[1].version = value


STRING_FIELDS: dict[str, Mutation] = {
    "attention.backend": _set("attention.backend"),
    "speculative.attention_backend": _set("speculative.attention_backend"),
    "hardware.device_name": _set("hardware.device_name"),
    "hardware.gcn_arch": _set("hardware.gcn_arch"),
    "hardware.libraries[0].name": _library_name,
    "hardware.libraries[1].version": _library_version,
    "target_layers.kv_cache_dtype": _set("target_layers.kv_cache_dtype"),
    "speculative.draft_layers.kv_cache_dtype": _set("speculative.draft_layers.kv_cache_dtype"),
}


def base() -> selector_pb2.SelectBackendsRequest:
    req = request(speculative=dflash())
    req.speculative.draft_layers.CopyFrom(req.target_layers)
    return req


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_selector(ServerSettings(port=0))
    yield running
    await running.stop(0)


@pytest.fixture
async def stub(server: RunningServer) -> AsyncIterator[selector_pb2_grpc.BackendSelectorStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield selector_pb2_grpc.BackendSelectorStub(channel)


def violated_fields(err: grpc.aio.AioRpcError) -> list[str]:
    assert rpc_status.from_call(err) is not None, "no google.rpc.Status in the trailers"
    return [v.field for v in field_violations(err)]


@pytest.mark.parametrize("field", list(STRING_FIELDS))
async def test_a_6_kb_string_is_invalid_argument_naming_its_field(stub, field: str) -> None:
    """Before: a 6 KB backend name came back as RESOURCE_EXHAUSTED "metadata size exceeds limit" (the error
    echoed it), a 6 KB device name or library version was accepted (and cached)."""
    req = base()
    await stub.SelectBackends(req, timeout=10)  # valid before the mutation
    STRING_FIELDS[field](req, "Q" * (6 * KiB))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(req, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:200]
    assert violated_fields(err.value) == [field]
    assert "Q" * 64 not in err.value.details()  # sizes are reported, not the values
    assert (await stub.SelectBackends(base(), timeout=10)).target.backend == "FLASH_ATTN"


async def test_too_many_libraries_or_layer_ids_are_refused(stub) -> None:
    req = base()
    for i in range(65):
        req.hardware.libraries.add(name=f"lib{i}", version="1")
    req.speculative.dflash_config.target_layer_ids.extend(range(2000))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(req, timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(err.value) == ["hardware.libraries", "speculative.dflash_config.target_layer_ids"]


async def test_a_request_over_the_largest_valid_one_is_refused_before_it_is_read(stub) -> None:
    """The message limit follows from the bounds (tens of KB), not 64 MiB."""
    req = base()
    req.attention.backend = "Q" * (1 << 20)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(req, timeout=10)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "message larger than max" in err.value.details()
    assert (await stub.SelectBackends(base(), timeout=10)).target.backend == "FLASH_ATTN"


async def test_errors_that_echo_large_values_still_reach_the_client() -> None:
    """Any handler's error is clipped in errors.py: a long echoed value, a thousand violations, a bug whose
    message holds the input. Before, each came back as RESOURCE_EXHAUSTED "metadata size exceeds limit"."""

    class Echoing(selector_pb2_grpc.BackendSelectorServicer):
        async def SelectBackends(self, req, context):
            value = req.hardware.device_name
            if req.attention.backend == "one":
                err = invalid_fields([FieldViolation("attention.backend", f"unknown backend {value!r}; try again")])
            elif req.attention.backend == "many":
                err = invalid_fields([FieldViolation(f"f{i}", f"bad: {value[:300]}") for i in range(1000)])
            else:
                raise RuntimeError(f"could not handle {value!r}")
            await context.abort_with_status(err.to_status())

    server, metrics = create_server(ServerSettings(), "test")
    selector_pb2_grpc.add_BackendSelectorServicer_to_server(Echoing(), server)
    running = await start_server(server, metrics, ServerSettings(port=0), [SERVICE])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = selector_pb2_grpc.BackendSelectorStub(channel)
            for backend, code in (
                ("one", grpc.StatusCode.INVALID_ARGUMENT),
                ("many", grpc.StatusCode.INVALID_ARGUMENT),
                ("bug", grpc.StatusCode.INTERNAL),
            ):
                req = selector_pb2.SelectBackendsRequest()
                req.attention.backend = backend
                req.hardware.device_name = "é" * (6 * KiB)  # non-ASCII: 9 bytes each in grpc-message
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SelectBackends(req, timeout=10)
                assert err.value.code() is code, (backend, err.value.details()[:200])
                details = err.value.details()
                assert len(details.encode()) <= 1024, backend
                if backend == "one":
                    assert details.startswith("invalid request: attention.backend: unknown backend 'ééé")
                    assert details.endswith("'; try again")  # the head and the tail stay, the middle goes
                    assert violated_fields(err.value) == ["attention.backend"]
                if backend == "many":
                    shown = violated_fields(err.value)
                    assert shown == [f"f{i}" for i in range(len(shown))] and 0 < len(shown) < 1000
                    assert details.endswith(f"({1000 - len(shown)} more violations not shown)")
    finally:
        await running.stop(0)


def _distinct(i: int, size: int) -> str:
    return f"{i:08d}" + "Q" * (size - 8)


async def _traced_growth(calls: Callable[[], object]) -> int:
    """Bytes of Python memory still held after `calls` (garbage collected), traced by tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        await calls()  # type: ignore[misc]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("size", [32 * KiB, 64 * KiB])
async def test_large_distinct_requests_leave_nothing_behind(stub, size: int, caplog: pytest.LogCaptureFixture) -> None:
    """50 distinct requests with a large backend name are refused (INVALID_ARGUMENT naming the field under the
    message limit, RESOURCE_EXHAUSTED over it) and leave neither cache entries nor long log lines. Before,
    the cache kept every request's bytes and error (RSS grew 3.6 MB per 1 MiB call) and each was logged whole."""
    caplog.set_level(logging.INFO, logger="specdec.rpc")
    codes: set[grpc.StatusCode] = set()

    async def call(i: int) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SelectBackends(request(backend=_distinct(i, size)), timeout=30)
        codes.add(err.value.code())
        if err.value.code() is grpc.StatusCode.INVALID_ARGUMENT:
            assert violated_fields(err.value) == ["attention.backend"]

    async def fifty_calls() -> None:  # at once: a refusal over the limit takes a TCP round of acks
        await asyncio.gather(*(call(i) for i in range(50)))

    await asyncio.gather(*(call(10_000 + i) for i in range(5)))  # warm up: metrics labels, channel buffers
    growth = await _traced_growth(fifty_calls)
    assert codes <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert growth < 50 * size // 4, f"{growth} bytes still held after 50 calls of {size} bytes"
    logged = [record for record in caplog.records if record.name == "specdec.rpc"]
    assert all(len(str(vars(record))) < 2048 for record in logged)


def test_the_cache_holds_only_checked_requests_by_what_selection_reads() -> None:
    """Refused requests are not cached; requests that differ only in fields selection ignores share one
    entry; the entry count is bounded."""
    selector = Selector(cache_size=16)
    for i in range(50):
        with pytest.raises(InvalidArgument, match=r"attention\.backend"):
            selector.select(request(backend=_distinct(i, 64 * KiB)))
    assert selector.cache_info().currsize == 0
    for i in range(100):
        req = request()
        req.hardware.device_name = f"GPU #{i}"
        req.hardware.total_memory_bytes = i << 30
        selector.select(req)
    assert selector.cache_info().currsize == 1
    for i in range(40):
        req = request()
        req.hardware.libraries.add(name="extra", version=f"1.{i}")
        selector.select(req)
    assert selector.cache_info().currsize == 16
