"""Big Generate requests against a real executor server: a message over the largest valid request is refused
before it is read (RESOURCE_EXHAUSTED), a request_id over 256 bytes is INVALID_ARGUMENT (it is echoed in
every response chunk: 5 MiB used to push each one over the client's 4 MiB limit), and a long text prompt is
tokenized off the event loop, through the tokenizer's GIL-free call. Before: a 60 MiB prompt was read,
listed and checked on the event loop (10 s, every stream frozen)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import torch
from executor_builders import load_request
from rpc_details import violated_fields

from executor_service.server.main import ExecutorOptions, RunningExecutor, start_executor
from executor_service.server.session import EngineSettings
from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.grpc_runtime import ServerSettings

MiB = 1 << 20
TIMEOUT_S = 60.0  # only so that a stuck call cannot hang the test


@pytest.fixture
async def executor() -> AsyncIterator[RunningExecutor]:
    running = await start_executor(
        ServerSettings(port=0), ExecutorOptions(device=torch.device("cpu"), engine=EngineSettings(64, 8))
    )
    yield running
    await running.stop(0.5)


@pytest.fixture
async def stub(executor: RunningExecutor) -> AsyncIterator[executor_pb2_grpc.ExecutorStub]:
    options = [("grpc.max_send_message_length", 64 * MiB)]  # the client's limit must not be what refuses
    async with grpc.aio.insecure_channel(f"127.0.0.1:{executor.server.port}", options=options) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        await stub.LoadModel(load_request(), timeout=TIMEOUT_S)
        yield stub


async def generate(stub, **fields: Any) -> list[executor_pb2.GenerateResponse]:
    request = executor_pb2.GenerateRequest(**fields)
    return [response async for response in stub.Generate(request, timeout=TIMEOUT_S)]


async def still_serving(stub) -> None:
    responses = await generate(
        stub, request_id="ok", token_ids=executor_pb2.TokenIds(ids=[1, 2, 3]), sampling={"max_tokens": 2}
    )
    assert responses[-1].finished.completion_tokens == 2


@pytest.mark.parametrize("kind", ["text", "token_ids"])
async def test_a_request_over_the_largest_valid_one_is_refused_unread(stub, kind: str) -> None:
    """9 MiB of text (at most 8 MiB is valid), or 9M token ids (more than any context LoadModel accepts)."""
    prompt = {"text": "w" * (9 * MiB)} if kind == "text" else {"token_ids": executor_pb2.TokenIds(ids=[7] * (9 * MiB))}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request_id="huge", **prompt)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "message larger than max" in err.value.details()
    await still_serving(stub)


async def test_a_prompt_longer_than_the_context_names_the_field(stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request_id="long", token_ids=executor_pb2.TokenIds(ids=[7] * MiB))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields(err.value) == ["token_ids"]
    assert "1048576 tokens" in err.value.details()


@pytest.mark.parametrize("size", [257, 5 * MiB])
async def test_a_long_request_id_is_invalid_argument(stub, size: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, request_id="r" * size, token_ids=executor_pb2.TokenIds(ids=[1, 2]))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()[:200]
    assert violated_fields(err.value) == ["request_id"]
    responses = await generate(
        stub, request_id="r" * 256, token_ids=executor_pb2.TokenIds(ids=[1]), sampling={"max_tokens": 1}
    )
    assert responses[-1].request_id == "r" * 256 and responses[-1].HasField("finished")


class RecordingTokenizer:
    """A tokenizers.Tokenizer that notes which of its encoding calls ran, and on which thread."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[str, threading.Thread]] = []

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("encode", threading.current_thread()))
        return self.tokenizer.encode(*args, **kwargs)

    def encode_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("encode_batch", threading.current_thread()))
        return self.tokenizer.encode_batch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


async def test_a_long_text_is_tokenized_off_the_event_loop(executor: RunningExecutor, stub) -> None:
    """`encode` holds the GIL for the whole text (seconds for megabytes): even on a worker thread it stops the
    event loop and the engine thread. A long text goes to a worker thread and through `encode_batch`, which
    releases the GIL; a short one is encoded at once."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(512)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.decoder = tokenizers.decoders.WordPiece()
    recording = RecordingTokenizer(words)
    executor.servicer.session.loaded.tokenizer = recording
    long_text = "w5" + " " * 100_000 + "w9"  # two tokens in 100 KB
    responses = await generate(stub, request_id="long", text=long_text, sampling={"max_tokens": 3})
    assert responses[-1].finished.prompt_tokens == 2 and responses[-1].finished.completion_tokens == 3
    ((method, thread),) = recording.calls
    assert method == "encode_batch" and thread is not threading.main_thread(), (method, thread.name)
    recording.calls.clear()
    await generate(stub, request_id="short", text="w5 w9", sampling={"max_tokens": 1})
    assert [method for method, _ in recording.calls] == ["encode"]
