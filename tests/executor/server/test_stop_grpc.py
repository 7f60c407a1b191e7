"""SamplingParams.stop over gRPC: a stop string inside a run of accepted drafts (EAGLE-3 and DFlash synthetic
drafters, with drafts that are the target's own continuation) ends the stream before it, with the tokens cut
at the token where it starts; the request is stopped in the engine; bad stop lists are refused by field."""

from __future__ import annotations

import grpc
import pytest
from executor_builders import load_request
from greedy_reference import greedy_reference
from rpc_details import violations
from spec_builders import ReplayDrafts, draft_model
from toy_model import VOCAB_SIZE, token_text, write_toy_model

from executor_service.server.main import RunningExecutor
from executor_service.server.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from specdec.v1 import common_pb2, executor_pb2

pytest.importorskip("tokenizers")
K = 4  # drafts per step: every verify step emits K + 1 tokens (all drafts accepted)


async def load_toy(stub, tmp_path, method: str | None = None) -> None:
    write_toy_model(tmp_path / "toy")
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path="toy"), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=64
    )
    if method is not None:
        request.draft.CopyFrom(draft_model(method, K))
    await stub.LoadModel(request)


async def generate(stub, request_id: str, ids: list[int], stop: list[str], max_tokens: int) -> list:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=ids),
        sampling=executor_pb2.SamplingParams(max_tokens=max_tokens, stop=stop),
    )
    return [r async for r in stub.Generate(request)]


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
async def test_a_stop_inside_accepted_drafts(executor: RunningExecutor, stub, tmp_path, method: str) -> None:
    await load_toy(stub, tmp_path, method)
    session = executor.servicer.session
    prompt, max_tokens = [5, 6, 7, 8, 9], 40
    expected = greedy_reference(session.loaded.model, prompt, max_tokens)
    session.proposer.replay = ReplayDrafts({"s": expected}, VOCAB_SIZE)  # every draft is accepted
    pieces = [token_text(t) for t in expected]
    text = "".join(pieces)
    # Token 0 comes from the prefill, then each verify step emits K accepted drafts and the target's own token:
    # tokens 1..K+1, K+2..2K+2, ... The stop starts in the last character of token 7 (an accepted draft) and
    # runs into token 8.
    at = sum(map(len, pieces[:8])) - 1
    stop = text[at : at + 3]
    first = text.find(stop)
    cut = next(i for i in range(len(pieces)) if sum(map(len, pieces[: i + 1])) > first)  # the token it starts in
    assert cut % (K + 1) != 0, "the stop must start in an accepted draft, not a token the target sampled"

    responses = await generate(stub, "s", prompt, [stop, "never matched 123"], max_tokens)
    shown = "".join(r.text for r in responses)
    assert shown == text[:first] and stop not in shown
    assert [t for r in responses for t in r.token_ids] == expected[:cut]
    finished = responses[-1].finished
    assert (finished.finish_reason, finished.completion_tokens) == ("stop", cut)
    assert sum(r.num_accepted for r in responses) == finished.accepted_tokens > 0
    assert [r.HasField("finished") for r in responses] == [False] * (len(responses) - 1) + [True]
    assert finished.drafted_tokens < max_tokens  # stopped in the engine, not run to max_tokens
    assert session.engine.num_live == 0 and session.kv_cache.allocator.num_used == 0

    # Held-back text that never becomes a stop string is released at the end, with every token.
    session.proposer.replay = ReplayDrafts({"h": expected}, VOCAB_SIZE)
    near_miss = text[at : at + 2] + "#"  # '#' is outside the toy alphabet: never matched
    responses = await generate(stub, "h", prompt, [near_miss], max_tokens)
    assert "".join(r.text for r in responses) == text
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].finished.finish_reason == "length"


async def test_bad_stop_lists_name_their_fields(executor: RunningExecutor, stub, tmp_path) -> None:
    await load_toy(stub, tmp_path)
    cases = [
        (["a"] * (MAX_STOP_STRINGS + 1), {"sampling.stop"}),
        (["a"] * 100_000, {"sampling.stop"}),
        (["ok", ""], {"sampling.stop[1]"}),
        (["x" * (MAX_STOP_STRING_CHARS + 1), "y" * 1_000_000], {"sampling.stop[0]", "sampling.stop[1]"}),
    ]
    for stop, expected in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, "bad", [1, 2], stop, 4)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert set(violations(err.value)) == expected
        assert len(err.value.details()) < 2000  # the values are not echoed
    assert (await generate(stub, "fine", [1, 2], ["a"] * MAX_STOP_STRINGS, 4))[-1].HasField("finished")


async def test_stop_strings_need_a_tokenizer(executor: RunningExecutor, stub) -> None:
    await stub.LoadModel(load_request())  # synthetic: token ids only
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(stub, "s", [1, 2], ["x"], 4)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert set(violations(err.value)) == {"sampling.stop"}
    responses = await generate(stub, "t", [1, 2], [], 4)  # no stop strings: token ids only, as before
    assert [t for r in responses for t in r.token_ids] == greedy_reference(
        executor.servicer.session.loaded.model, [1, 2], 4
    )
