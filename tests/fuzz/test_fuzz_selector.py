"""Fuzzing the selector process: every request message of BackendSelector, blind and near-valid, and raw bytes.

Each example must get an answer or a refusal a client can act on (never INTERNAL / UNKNOWN / a hang; an
INVALID_ARGUMENT names the request's fields; messages stay short), and the server must still give the same
answer to a known-good request afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from builders import cpu, cuda, dflash, eagle, layers, request, rocm
from fuzz_checks import Shown, check_refusal
from fuzz_servers import FuzzedServer
from hypothesis import given
from hypothesis import strategies as st
from proto_strategies import BACKEND_NAMES, messages, near, strings

from kernels.capabilities import BACKENDS, KV_CACHE_DTYPES
from specdec.v1 import common_pb2, selector_pb2, selector_pb2_grpc

RPC_TIMEOUT_S = 30.0  # a no-hang bound
SELECTOR_FIELDS = {
    "attention.backend": strings(BACKEND_NAMES),
    "speculative.attention_backend": strings(BACKEND_NAMES),
    "target_layers.kv_cache_dtype": strings(KV_CACHE_DTYPES),
    "speculative.draft_layers.kv_cache_dtype": strings(KV_CACHE_DTYPES),
    "hardware.gcn_arch": strings(("gfx942", "gfx90a", "GFX942", "gfx1100")),
    "hardware.libraries": st.lists(
        st.builds(
            common_pb2.KernelLibrary,
            name=strings(("torch", "triton", "flash_attn", "flashinfer", "aiter")),
            version=strings(("2.11.0", "3.6.0", "4.0.0b36", "0.0", "999")),
        ),
        max_size=4,
    ),
}
VALID_REQUESTS = (
    request(),
    request(hardware=cpu(), target=layers(dtype=common_pb2.DTYPE_FLOAT32, head_size=64)),
    request(speculative=dflash()),
    request(speculative=eagle()),
    request(hardware=rocm(), speculative=eagle(k=7)),
    request(hardware=cuda(10, 0, flash_attn="4.0.0b36"), backend="FLASH_ATTN", speculative=dflash(causal=True)),
)
KNOWN_GOOD = request(hardware=cpu(), target=layers(dtype=common_pb2.DTYPE_FLOAT32, head_size=64))


def _probe(server: FuzzedServer) -> None:
    stub = selector_pb2_grpc.BackendSelectorStub(server.channel)
    answer = stub.SelectBackends(KNOWN_GOOD, timeout=RPC_TIMEOUT_S)
    assert answer.target.backend == "CPU_ATTN", answer


@pytest.fixture(scope="module")
def selector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzedServer]:
    directory: Path = tmp_path_factory.mktemp("fuzz-selector")
    server = FuzzedServer("selector", directory, (), prepare=lambda s: None, probe=_probe)
    yield server
    failure = server.stop()
    assert failure is None, failure


def select(server: FuzzedServer, shown: Shown) -> None:
    server.ready()
    stub = selector_pb2_grpc.BackendSelectorStub(server.channel)
    try:
        answer = stub.SelectBackends(shown.message, timeout=RPC_TIMEOUT_S)
        assert answer.target.backend in BACKENDS, answer
        assert not answer.HasField("drafter") or answer.drafter.backend in BACKENDS, answer
    except grpc.RpcError as err:
        check_refusal(err, shown.message, "SelectBackends")
    server.check_serving(f"after SelectBackends {shown!r}")


@given(messages(selector_pb2.SelectBackendsRequest, SELECTOR_FIELDS).map(Shown))
def test_select_backends_any_request(selector: FuzzedServer, shown: Shown) -> None:
    select(selector, shown)


@given(near(st.sampled_from(VALID_REQUESTS), SELECTOR_FIELDS).map(Shown))
def test_select_backends_near_valid_request(selector: FuzzedServer, shown: Shown) -> None:
    select(selector, shown)


@given(messages(selector_pb2.ListBackendsRequest).map(Shown))
def test_list_backends_any_request(selector: FuzzedServer, shown: Shown) -> None:
    selector.ready()
    stub = selector_pb2_grpc.BackendSelectorStub(selector.channel)
    try:
        answer = stub.ListBackends(shown.message, timeout=RPC_TIMEOUT_S)
        assert answer.reason_vocabulary, answer
    except grpc.RpcError as err:
        check_refusal(err, shown.message, "ListBackends")
    selector.check_serving(f"after ListBackends {shown!r}")


@given(st.sampled_from(("SelectBackends", "ListBackends")), st.binary(max_size=256))
def test_any_bytes(selector: FuzzedServer, method: str, payload: bytes) -> None:
    """Bytes that may not parse as the request at all: refused or answered, never a bug."""
    selector.ready()
    assert selector.channel is not None
    call = selector.channel.unary_unary(f"/specdec.v1.BackendSelector/{method}")
    request_class = getattr(selector_pb2, f"{method}Request")
    try:
        call(payload, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in (err.details() or ""):
            return selector.check_serving(f"after {method} bytes {payload!r}")  # nothing parsed: no field to name
        check_refusal(err, request_class.FromString(payload), method)
    selector.check_serving(f"after {method} bytes {payload!r}")
