"""min_p, the penalties and logprobs through gRPC, on the CPU, with an EAGLE-3 drafter loaded: hostile values
refused with a field violation each; greedy with penalties equal to the penalised reference; min_p 1 keeping
the top token only; one TokenLogprob per streamed token, equal to the target's dense log-softmax, also for
accepted drafts (the drafter replays the reference, wrong at its third draft)."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch
from executor_builders import load_request
from greedy_reference import dense_logits, greedy_reference
from penalty_reference import greedy_penalised
from rpc_details import violations
from spec_builders import ReplayDrafts, draft_model

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2

PROMPT = [5, 9, 5, 5, 17, 9, 2]
MAX_TOKENS = 12
BAD = {  # field -> values refused
    "min_p": [-0.1, 1.5, math.nan, math.inf],
    "repetition_penalty": [0.0, -1.0, math.nan, math.inf],
    "presence_penalty": [2.5, -math.inf, math.nan],
    "frequency_penalty": [-3.0, math.inf, math.nan],
    "logprobs": [21, -1, 2**31 - 1],
}
EDGES = [  # accepted
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"repetition_penalty": 1e-30},
    {"repetition_penalty": 1e30},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"logprobs": 0},
    {"logprobs": 20},
]


async def generate(stub, request_id: str, **sampling: object) -> list[executor_pb2.GenerateResponse]:
    request = executor_pb2.GenerateRequest(
        request_id=request_id,
        token_ids=executor_pb2.TokenIds(ids=PROMPT),
        sampling=executor_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling),
    )
    return [response async for response in stub.Generate(request)]


async def load(stub) -> None:
    request = load_request(num_kv_blocks=64)
    request.draft.CopyFrom(draft_model("eagle3", 3))
    await stub.LoadModel(request)


def tokens(responses: list[executor_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_hostile_values_name_their_fields(executor: RunningExecutor, stub) -> None:
    await load(stub)
    for field, values in BAD.items():
        for value in values:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, "bad", **{field: value})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, value)
            assert set(violations(err.value)) == {f"sampling.{field}"}, (field, value)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # every bad field at once
        await generate(stub, "bad", **{field: values[0] for field, values in BAD.items()})
    assert set(violations(err.value)) == {f"sampling.{field}" for field in BAD}
    for edge in EDGES:
        responses = await generate(stub, "edge", **edge)
        assert len(tokens(responses)) == MAX_TOKENS and responses[-1].finished.finish_reason == "length", edge
    assert executor.servicer.session.kv_cache.allocator.num_used == 0


async def test_logit_bias_is_checked_entry_by_entry_and_bites(executor: RunningExecutor, stub) -> None:
    """Out of the vocabulary, twice, past +-100 or not finite: a violation naming the entry's field; more than 1024
    entries: refused before anything is read. A +100 bias forces its token; -100 bans the target's own choice."""
    await load(stub)
    vocab = executor.servicer.session.limits.vocab_size
    bias = executor_pb2.LogitBias
    hostile = {
        "sampling.logit_bias[0].token_id": [bias(token_id=vocab, bias=1.0)],
        "sampling.logit_bias[1].token_id": [bias(token_id=3, bias=1.0), bias(token_id=3, bias=2.0)],
        "sampling.logit_bias[0].bias": [bias(token_id=3, bias=100.5)],
        "sampling.logit_bias[2].bias": [bias(token_id=1), bias(token_id=2), bias(token_id=4, bias=math.nan)],
        "sampling.logit_bias": [bias(token_id=i % vocab, bias=1.0) for i in range(1025)],
    }
    for field, entries in hostile.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, "bad", logit_bias=entries)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and set(violations(err.value)) == {field}, field
        assert len(err.value.details()) < 500
    forced = tokens(await generate(stub, "forced", logit_bias=[bias(token_id=7, bias=100.0)]))
    assert forced == [7] * MAX_TOKENS
    own = greedy_reference(executor.servicer.session.loaded.model, PROMPT, MAX_TOKENS)
    banned = tokens(await generate(stub, "banned", logit_bias=[bias(token_id=t, bias=-100.0) for t in set(own)]))
    assert len(banned) == MAX_TOKENS and not set(banned) & set(own)
    assert executor.servicer.session.kv_cache.allocator.num_used == 0


async def test_penalties_min_p_and_logprobs_against_references(executor: RunningExecutor, stub) -> None:
    await load(stub)
    model = executor.servicer.session.loaded.model
    penalties = {"repetition_penalty": 1.8, "presence_penalty": 1.5, "frequency_penalty": 1.2}
    settings = SamplingSettings(**penalties)  # type: ignore[arg-type]
    expected = greedy_penalised(model, PROMPT, MAX_TOKENS, settings)
    plain_expected = greedy_reference(model, PROMPT, MAX_TOKENS)
    assert expected != plain_expected  # the penalties change the answer
    replies = {"penalised": expected, "min_p": expected, "logprobs": expected, "plain": plain_expected}
    executor.servicer.session.proposer.replay = ReplayDrafts(replies, 512, wrong_at=2)  # 2 accepted per step
    penalised, top_only, with_logprobs, plain = await asyncio.gather(
        generate(stub, "penalised", **penalties),
        generate(stub, "min_p", temperature=1.0, min_p=1.0, seed=3, **penalties),  # the top token only
        generate(stub, "logprobs", logprobs=20, **penalties),
        generate(stub, "plain"),
    )
    assert tokens(penalised) == tokens(top_only) == tokens(with_logprobs) == expected
    assert tokens(plain) == plain_expected
    assert all(not r.logprobs for r in penalised + top_only + plain)
    for response in with_logprobs:
        assert [lp.token_id for lp in response.logprobs] == list(response.token_ids)
    found = [lp for r in with_logprobs for lp in r.logprobs]
    dense = torch.log_softmax(dense_logits(model, PROMPT + expected)[len(PROMPT) - 1 : -1], dim=-1)  # raw target
    for i, token in enumerate(found):
        assert token.logprob == pytest.approx(float(dense[i, expected[i]]), abs=1e-4)
        top = dense[i].topk(20)
        assert [t.token_id for t in token.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert with_logprobs[-1].finished.accepted_tokens > 0  # logprobs of accepted drafts: the target's
    assert executor.servicer.session.kv_cache.allocator.num_used == 0
