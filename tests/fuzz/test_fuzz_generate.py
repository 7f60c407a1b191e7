"""Fuzzing an executor process's Generate, Abort and the other Executor RPCs, on a tiny synthetic target with
each kind of stand-in drafter (EAGLE, EAGLE-3, DFlash causal and not, several k) or none.

Streams run side by side with hostile sampling values, prompts that fill the KV cache exactly (or by one token
too many), duplicate ids, cancels and Aborts. Every stream must end as its request allows (fuzz_executor.py),
and after each example the engine must hold no request and no KV block and still serve a known-good request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from executor_builders import TINY, load_request
from fuzz_checks import Shown, check_refusal
from fuzz_executor import (
    LOAD_TIMEOUT_S,
    MAX_STREAMS,
    RPC_TIMEOUT_S,
    StreamOutcome,
    StreamPlan,
    check_stream,
    fuzzed_executor,
    model_info,
    run_streams,
    settle,
    stub,
    unique_id,
)
from fuzz_servers import ADDRESS_SPACE_LIMIT_BYTES, FuzzedServer
from hypothesis import example, given
from hypothesis import strategies as st
from proto_strategies import int32s, int64s, messages, oversize, strings
from spec_builders import draft_model

from specdec.v1 import executor_pb2

NUM_KV_BLOCKS = 64  # 1,024 tokens of cache: prompts can fill it exactly and stay cheap
BLOCK_SIZE = 16
CAPACITY = NUM_KV_BLOCKS * BLOCK_SIZE
VOCAB = TINY["vocab_size"]
METHODS = (None, "eagle", "eagle3", "dflash", "dflash_causal")
KS = (1, 3, 4, 7)
OWN_KS = (None, None, None, 0, 0, 1, 3, 8, -1, 2**31 - 1)  # GenerateRequest.num_speculative_tokens
TINY_TEMPERATURES = (1e-45, 1e-38, 1e-30, 1e-6)  # issue 13 item 1: 1e-38 and 1e-45 failed the whole batch
TEMPERATURES = (0.0, -0.0, *TINY_TEMPERATURES, 0.01, 0.7, 1.0, 2.0, 100.0, 1e30, 3.4e38, math.inf, -1.0, math.nan)
TOP_PS = (1e-45, 1e-8, 0.1, 0.5, 0.95, 1.0, 0.0, 1.5, math.nan)
TOP_KS = (0, 1, 2, 40, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1, -1)
MIN_PS = (0.0, 1e-45, 0.05, 0.5, 1.0, -0.1, 1.5, math.nan)
REPETITION_PENALTIES = (1e-45, 1e-30, 0.5, 1.0, 1.3, 1e30, 3.4e38, 0.0, -1.0, math.inf, math.nan)
PENALTIES = (-2.0, -0.5, 0.0, 1.0, 2.0, 2.5, -math.inf, math.nan)  # presence and frequency
LOGPROBS = (0, 1, 20, 21, -1, 2**31 - 1)


@dataclass(frozen=True)
class Model:
    """The tiny target, and a stand-in drafter of `method` proposing k tokens (None: no drafter)."""

    method: str | None = None
    k: int = 0

    def load_request(self) -> executor_pb2.LoadModelRequest:
        request = load_request(num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE)
        if self.method is not None:
            request.draft.CopyFrom(draft_model(self.method, self.k))
        return request


@dataclass
class Scenario:
    model: Model
    plans: list[StreamPlan]


class Executor:
    """The fuzzed executor and the model it has loaded now."""

    def __init__(self, directory: Path) -> None:
        self.model: Model | None = None
        self.server = fuzzed_executor(directory, lambda server: self._load(server, Model()))

    def _load(self, server: FuzzedServer, model: Model) -> None:
        self.model = None
        stub(server).LoadModel(model.load_request(), timeout=LOAD_TIMEOUT_S)
        self.model = model

    def use(self, model: Model) -> None:
        self.server.ready()
        if self.model != model:
            self._load(self.server, model)


@pytest.fixture(scope="module")
def executor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executor]:
    executor = Executor(tmp_path_factory.mktemp("fuzz-generate"))
    yield executor
    failure = executor.server.stop()
    assert failure is None, failure


def sampling(max_tokens: int | None) -> st.SearchStrategy[executor_pb2.SamplingParams]:
    """Mostly sane values, with the tiny, huge, negative and NaN ones among them."""

    @st.composite
    def build(draw: st.DrawFn) -> executor_pb2.SamplingParams:
        params = executor_pb2.SamplingParams(
            temperature=draw(st.one_of(st.sampled_from(TEMPERATURES), st.floats(0, 4, width=32))),
            top_k=draw(st.sampled_from(TOP_KS)),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
            ignore_eos=draw(st.booleans()),
        )
        if max_tokens is not None:
            params.max_tokens = max_tokens
        if (top_p := draw(st.none() | st.sampled_from(TOP_PS))) is not None:
            params.top_p = top_p
        if (seed := draw(st.none() | int64s())) is not None:
            params.seed = seed
        optional = {
            "min_p": MIN_PS,
            "repetition_penalty": REPETITION_PENALTIES,
            "presence_penalty": PENALTIES,
            "frequency_penalty": PENALTIES,
            "logprobs": LOGPROBS,
        }
        for name, values in optional.items():
            if (value := draw(st.none() | st.sampled_from(values))) is not None:
                setattr(params, name, value)
        return params

    return build()


@st.composite
def stream_plans(draw: st.DrawFn, request_id: str) -> StreamPlan:
    """A prompt that is short, fills the cache with its max_tokens exactly, leaves one token free, or is one
    token too long; its ids all alike, random, or the vocabulary's edges."""
    max_tokens = draw(st.one_of(st.integers(1, 24), st.sampled_from((None, 0, -1, 2**31 - 1))))
    room = max_tokens if max_tokens is not None and 0 < max_tokens <= CAPACITY else draw(st.integers(1, 24))
    shape = draw(st.sampled_from(("short", "fill", "fill-1", "over")))
    if shape == "short":
        length = draw(st.integers(1, 40))
    else:
        length = CAPACITY - room + {"fill": 0, "fill-1": -1, "over": 1}[shape]
    content = draw(st.sampled_from(("same", "random", "edges")))
    if content == "same":
        ids = [draw(st.integers(0, VOCAB - 1))] * length
    elif content == "random":
        ids = random.Random(draw(st.integers(0, 2**32))).choices(range(VOCAB), k=length)
    else:
        ids = [0, VOCAB - 1] * (length // 2) + [0] * (length % 2)
    request = executor_pb2.GenerateRequest(
        request_id=request_id, token_ids=executor_pb2.TokenIds(ids=ids), sampling=draw(sampling(max_tokens))
    )
    if (own_k := draw(st.sampled_from(OWN_KS))) is not None:  # per-request speculation, in range or not
        request.num_speculative_tokens = own_k
    return StreamPlan(request, draw(st.sampled_from(("finish", "finish", "finish", "cancel", "abort"))))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    method = draw(st.sampled_from(METHODS))
    model = Model(method, draw(st.sampled_from(KS)) if method else 0)
    plans: list[StreamPlan] = []
    for _ in range(draw(st.integers(1, MAX_STREAMS))):
        reuse = plans and draw(st.integers(0, 9)) == 0  # now and then an id that is already running
        plans.append(draw(stream_plans(plans[-1].request.request_id if reuse else unique_id("fuzz"))))
    return Scenario(model, plans)


def plan(ids: list[int], max_tokens: int, temperature: float = 0.0) -> StreamPlan:
    params = executor_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens)
    return StreamPlan(
        executor_pb2.GenerateRequest(
            request_id=unique_id("example"), token_ids=executor_pb2.TokenIds(ids=ids), sampling=params
        )
    )


# Issue 13's findings, always tried first: a tiny temperature beside a healthy stream in the same step (1), and a
# prompt + max_tokens that fill the cache exactly with a DFlash drafter (4).
@example(Scenario(Model(), [plan([1, 2, 3], 8, temperature=1e-38), plan([4, 5], 8)]))
@example(Scenario(Model("dflash", 4), [plan([7] * 1000, 24)]))
@given(scenarios())
def test_streams_end_as_their_requests_allow(executor: Executor, scenario: Scenario) -> None:
    executor.use(scenario.model)
    info = model_info(executor.server)
    for outcome in run_streams(executor.server, scenario.plans):
        check_stream(outcome, info)
    settle(executor.server, f"after {scenario!r}")


GENERATE_FIELDS = {
    "token_ids.ids": st.one_of(
        st.lists(st.integers(0, VOCAB - 1), max_size=64), st.lists(int32s(), max_size=8), oversize(int32s())
    ),
    "request_id": strings(("a", "same-id")),
}


@given(messages(executor_pb2.GenerateRequest, GENERATE_FIELDS).map(Shown))
def test_generate_any_request(executor: Executor, shown: Shown) -> None:
    executor.use(Model("eagle3", 3))
    info = model_info(executor.server)
    (outcome,) = run_streams(executor.server, [StreamPlan(shown.message)])
    check_stream(outcome, info)
    settle(executor.server, f"after {shown!r}")


@given(messages(executor_pb2.AbortRequest).map(Shown), st.booleans())
def test_abort_any_request(executor: Executor, shown: Shown, include_running: bool) -> None:
    """A fuzzed Abort while a stream runs (its id among those asked for, or not): it aborts only live ids
    that were asked for, and the stream ends as a stream should."""
    executor.use(Model("dflash", 3))
    info = model_info(executor.server)
    running = plan([3, 1, 4, 1, 5], 200)
    abort = shown.message
    if include_running:
        abort.request_ids.append(running.request.request_id)
        running.fate = "abort"
    call = stub(executor.server).Generate(running.request, timeout=RPC_TIMEOUT_S)
    first = next(call)
    try:
        answer = stub(executor.server).Abort(abort, timeout=RPC_TIMEOUT_S)
        assert set(answer.aborted_request_ids) <= set(abort.request_ids), answer
    except grpc.RpcError as err:
        check_refusal(err, abort, "Abort")
    rest = list(call)
    check_stream(StreamOutcome(running, [first, *rest]), info)
    settle(executor.server, f"after {shown!r}")


EXECUTOR_METHODS = {
    "GetCapabilities": executor_pb2.GetCapabilitiesRequest,
    "GetModelInfo": executor_pb2.GetModelInfoRequest,
    "Abort": executor_pb2.AbortRequest,
    "Generate": executor_pb2.GenerateRequest,
}


@given(st.sampled_from(sorted(EXECUTOR_METHODS)), st.binary(max_size=256))
def test_any_bytes(executor: Executor, method: str, payload: bytes) -> None:
    """Bytes that may not parse as the request: refused or answered, never a bug (LoadModel's bytes are
    fuzzed in test_fuzz_load.py, where a replaced model is expected)."""
    executor.server.ready()
    channel = executor.server.channel
    assert channel is not None
    path = f"/specdec.v1.Executor/{method}"
    call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
    try:
        answer = call(payload, timeout=RPC_TIMEOUT_S)
        if method == "Generate":
            list(answer)
    except grpc.RpcError as err:
        if not (err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in (err.details() or "")):
            check_refusal(err, EXECUTOR_METHODS[method].FromString(payload), method)
    settle(executor.server, f"after {method} bytes {payload!r}")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc")
def test_the_fuzzed_executor_runs_under_its_address_space_limit(executor: Executor) -> None:
    """The limit is set by a launcher that execs the server (server_processes.LIMITED_LAUNCH), not in a forked
    child: what the executor itself runs under must still be it."""
    assert executor.server.process is not None
    limits = Path(f"/proc/{executor.server.process.process.pid}/limits").read_text()
    (line,) = [line for line in limits.splitlines() if line.startswith("Max address space")]
    assert line.split()[3:5] == [str(ADDRESS_SPACE_LIMIT_BYTES)] * 2, line
