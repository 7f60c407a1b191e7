"""An executor process for fuzzing, and Generate streams run side by side and checked token for token.

A stream's plan says what its client does: read to the end, cancel after the first chunk, or Abort its id
after the first chunk. Every stream must then end as promised: refused with a status a client can act on, or
streamed to its `finished` message with exactly the tokens its request allows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from fuzz_checks import check_refusal, shown, wait_until_idle
from fuzz_servers import FuzzedServer

from specdec.v1 import executor_pb2, executor_pb2_grpc

RPC_TIMEOUT_S = 60.0  # a no-hang bound for one call or one whole stream, not a performance bar
LOAD_TIMEOUT_S = 120.0
MAX_STREAMS = 4
_ids = itertools.count()


def unique_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def stub(server: FuzzedServer) -> executor_pb2_grpc.ExecutorStub:
    return executor_pb2_grpc.ExecutorStub(server.channel)


def probe(server: FuzzedServer) -> None:
    """The known-good request: three prompt tokens, four new ones, on whatever model is loaded (token 0 alone and
    EOS ignored: a loaded vocabulary may hold a single token, as the deep fuzzer's did)."""
    request = executor_pb2.GenerateRequest(
        request_id=unique_id("probe"),
        token_ids=executor_pb2.TokenIds(ids=[0, 0, 0]),
        sampling=executor_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    responses = list(stub(server).Generate(request, timeout=RPC_TIMEOUT_S))
    tokens = [t for r in responses for t in r.token_ids]
    assert len(tokens) == 4 and responses[-1].finished.finish_reason == "length", responses[-1]


def fuzzed_executor(
    directory: Path, prepare: Callable[[FuzzedServer], None], *args: str, check: Callable[[FuzzedServer], None] = probe
) -> FuzzedServer:
    """An executor on the CPU with /metrics on a free port, under the address-space limit."""
    return FuzzedServer(
        "executor", directory, ("--device", "cpu", "--metrics-port", "0", *args), prepare, check, limit_memory=True
    )


def model_info(server: FuzzedServer) -> executor_pb2.ModelInfo:
    return stub(server).GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S).info


def settle(server: FuzzedServer, context: str) -> None:
    """After an example: the engine holds no request and no block, and the server still serves."""
    wait_until_idle(server.metrics_port(), context)
    server.check_serving(context)


@dataclass
class StreamPlan:
    request: executor_pb2.GenerateRequest
    fate: str = "finish"  # "finish": read to the end | "cancel" | "abort": after the first chunk

    def __repr__(self) -> str:
        return f"StreamPlan({shown(self.request)}, fate={self.fate!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # how hypothesis prints a failing example
        printer.text(repr(self))


@dataclass
class StreamOutcome:
    plan: StreamPlan
    responses: list[executor_pb2.GenerateResponse] = field(default_factory=list)
    error: grpc.RpcError | None = None


def run_streams(server: FuzzedServer, plans: list[StreamPlan]) -> list[StreamOutcome]:
    """All streams at once, each on its own thread."""
    with ThreadPoolExecutor(max_workers=MAX_STREAMS) as pool:
        return list(pool.map(lambda plan: _run(server, plan), plans))


def _run(server: FuzzedServer, plan: StreamPlan) -> StreamOutcome:
    outcome = StreamOutcome(plan)
    call = stub(server).Generate(plan.request, timeout=RPC_TIMEOUT_S)
    try:
        for response in call:
            outcome.responses.append(response)
            if len(outcome.responses) == 1 and plan.fate == "cancel":
                call.cancel()
            elif len(outcome.responses) == 1 and plan.fate == "abort":
                ids = [plan.request.request_id]
                stub(server).Abort(executor_pb2.AbortRequest(request_ids=ids), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        outcome.error = err
    return outcome


def check_stream(outcome: StreamOutcome, info: executor_pb2.ModelInfo) -> None:
    """A refusal a client can act on, or a complete stream with exactly the tokens its request allows."""
    plan, request = outcome.plan, outcome.plan.request
    if outcome.error is not None:
        if outcome.error.code() == grpc.StatusCode.CANCELLED and plan.fate == "cancel":
            return
        check_refusal(outcome.error, request, "Generate")
        return
    responses = outcome.responses
    where = f"{plan!r} got {len(responses)} messages"
    assert responses and responses[-1].HasField("finished"), f"a stream ended without `finished`: {where}"
    assert not any(r.HasField("finished") for r in responses[:-1]), f"`finished` before the end: {where}"
    assert all(r.request_id == request.request_id for r in responses), where
    tokens = [t for r in responses for t in r.token_ids]
    for response in responses:  # logprobs: one per token of each message, when asked for
        asked = request.sampling.HasField("logprobs")
        assert [lp.token_id for lp in response.logprobs] == (list(response.token_ids) if asked else []), where
        assert all(len(lp.top_logprobs) == request.sampling.logprobs for lp in response.logprobs), where
    finished = responses[-1].finished
    where = f"{where}, {len(tokens)} tokens, finished {finished}"
    assert all(0 <= t < info.vocab_size for t in tokens), f"a token outside the vocabulary: {where}"
    assert finished.completion_tokens == len(tokens), where
    prompt = len(request.token_ids.ids)
    assert finished.prompt_tokens == prompt, where
    room = min(info.max_model_len, info.num_kv_blocks * info.block_size) - prompt
    explicit = request.sampling.HasField("max_tokens")
    allowed = request.sampling.max_tokens if explicit else room
    if finished.finish_reason == "length" and explicit:
        assert len(tokens) == allowed, f"'length' after {len(tokens)} of max_tokens {allowed}: {where}"
    elif finished.finish_reason == "length":  # up to the context or cache, less a drafter's lookahead if any
        assert 0 < len(tokens) <= room, f"'length' after {len(tokens)} tokens, {room} free: {where}"
    elif finished.finish_reason == "stop":
        stops = {*request.sampling.stop_token_ids, *([] if request.sampling.ignore_eos else [info.eos_token_id])}
        assert tokens and tokens[-1] in stops, f"'stop' without a stop token: {where}"
        assert len(tokens) <= allowed, where
    else:
        assert finished.finish_reason == "abort" and plan.fate in ("abort", "cancel"), f"unasked-for end: {where}"
        assert len(tokens) <= allowed, where
