"""The `authorization` metadata is read strictly: one entry, `Bearer`, one space, the token, nothing else.
Before, spaces around the value or the token and a second entry were accepted."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from builders import request

from selector_service.main import start_selector
from specdec.v1 import selector_pb2_grpc
from specdec_runtime.grpc_runtime import RunningServer, ServerSettings

TOKEN = "strict-Token_0123456789"


@pytest.fixture
async def stub() -> AsyncIterator[selector_pb2_grpc.BackendSelectorStub]:
    running: RunningServer = await start_selector(ServerSettings(port=0, auth_token=TOKEN))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield selector_pb2_grpc.BackendSelectorStub(channel)
    finally:
        await running.stop(0)


REFUSED = {
    "two spaces": [("authorization", f"Bearer  {TOKEN}")],
    "leading space": [("authorization", f" Bearer {TOKEN}")],
    "trailing space": [("authorization", f"Bearer {TOKEN} ")],
    "a second word": [("authorization", f"Bearer {TOKEN} extra")],
    "no token": [("authorization", "Bearer ")],
    "the token alone": [("authorization", TOKEN)],
    "two entries, right then wrong": [("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer wrong")],
    "two right entries": [("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}")],
}


@pytest.mark.parametrize("metadata", list(REFUSED.values()), ids=list(REFUSED))
async def test_loose_authorization_values_are_refused(stub, metadata: list[tuple[str, str]]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SelectBackends(request(), metadata=metadata, timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in err.value.details()


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_exact_form_is_served(stub, scheme: str) -> None:
    """RFC 7235: the scheme's case does not matter; everything else must be exact."""
    reply = await stub.SelectBackends(request(), metadata=[("authorization", f"{scheme} {TOKEN}")], timeout=10)
    assert reply.target.backend == "FLASH_ATTN"
