"""Fuzzing an executor process's LoadModel: blind requests, near-valid ones (a working tiny target, with or
without a drafter of each kind, with one to three fields replaced by hostile values) and raw bytes, with a
--model-root that holds a loadable tiny checkpoint next to broken ones (wrong config types, an invalid
generation_config.json, a truncated drafter checkpoint, a symlink loop).

Whatever the request, LoadModel must answer in bounded time with a status a client can act on. A refused
LoadModel leaves the model that was loaded serving (health SERVING, the same ModelInfo, a known-good request
works); an accepted one serves a one-token prompt, and a prompt that fills its context or cache up to
max_tokens gets exactly max_tokens tokens. Either way the engine holds nothing afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from executor_builders import load_request, tiny_model
from fuzz_checks import Shown, check_refusal
from fuzz_executor import (
    LOAD_TIMEOUT_S,
    RPC_TIMEOUT_S,
    StreamPlan,
    check_stream,
    fuzzed_executor,
    model_info,
    run_streams,
    settle,
    stub,
    unique_id,
)
from fuzz_servers import FuzzedServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st
from proto_strategies import BACKEND_NAMES, messages, near, strings
from spec_builders import draft_model

from executor_service.models.draft_models import TargetHeads
from executor_service.models.draft_weights import save_drafter, synthetic_drafter
from executor_service.models.loader import save_directory
from executor_service.server.drafting import resolve_draft
from specdec.v1 import common_pb2, executor_pb2

NUM_KV_BLOCKS = 64
EXACT_FILL_MAX_TOKENS = 8
EXACT_FILL_MAX_CONTEXT = 4096  # longer contexts are checked with a short prompt only (time)
PATHS = ("tiny", "eagle3", "bad-types", "bad-generation", "bad-drafter", "loop-a", "tiny/", "./tiny", "/tiny")
LOAD_FIELDS = {
    "target.path": strings(PATHS),
    "draft.source.path": strings(PATHS),
    "target.synthetic.architecture": strings(("llama", "qwen3")),
    "draft.source.synthetic.architecture": strings(("llama", "qwen3")),
    "attention.backend": strings(BACKEND_NAMES),
    "draft.attention_backend": strings(BACKEND_NAMES),
}


def baseline() -> executor_pb2.LoadModelRequest:
    """What each example starts from: the tiny target with an EAGLE-3 drafter."""
    request = load_request(num_kv_blocks=NUM_KV_BLOCKS)
    request.draft.CopyFrom(draft_model("eagle3", 3))
    return request


def valid_requests() -> list[executor_pb2.LoadModelRequest]:
    """Loadable requests of every kind: synthetic targets with each drafter (or none), and checkpoints."""
    found = [load_request(num_kv_blocks=NUM_KV_BLOCKS), baseline()]
    for method, k in (("eagle", 4), ("dflash", 4), ("dflash_causal", 2)):
        request = load_request(num_kv_blocks=NUM_KV_BLOCKS)
        request.draft.CopyFrom(draft_model(method, k))
        found.append(request)
    from_files = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path="tiny"), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=NUM_KV_BLOCKS
    )
    from_files.draft.method = common_pb2.SPEC_METHOD_EAGLE3
    from_files.draft.source.path = "eagle3"
    found.append(from_files)
    return found


def write_model_root(root: Path) -> None:
    """A tiny target and EAGLE-3 drafter that load, and broken neighbours."""
    target = tiny_model()
    save_directory(target.model, root / "tiny")
    draft = resolve_draft(draft_model("eagle3", 3), target.config, None)
    heads = TargetHeads(target.model.embed_tokens, target.model.lm_head)
    drafter = synthetic_drafter(draft.config, heads, 7, torch.float32, torch.device("cpu"))
    save_drafter(drafter, target.config.num_layers, root / "eagle3")
    save_directory(target.model, root / "bad-types")
    raw = json.loads((root / "bad-types" / "config.json").read_text())
    raw.update(vocab_size="512", num_key_value_heads=[2], rope_theta="fast")
    (root / "bad-types" / "config.json").write_text(json.dumps(raw))
    save_directory(target.model, root / "bad-generation")
    (root / "bad-generation" / "generation_config.json").write_text("{not json")
    save_drafter(drafter, target.config.num_layers, root / "bad-drafter")
    weights = root / "bad-drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")


def health(server: FuzzedServer) -> int:
    check = health_pb2.HealthCheckRequest(service="specdec.v1.Executor")
    return health_pb2_grpc.HealthStub(server.channel).Check(check, timeout=RPC_TIMEOUT_S).status


class Loader:
    """The fuzzed executor; `fresh` is False once an example has loaded something other than the baseline."""

    def __init__(self, directory: Path, model_root: Path) -> None:
        self.fresh = False
        self.server = fuzzed_executor(directory, self._load_baseline, "--model-root", str(model_root))

    def _load_baseline(self, server: FuzzedServer) -> None:
        stub(server).LoadModel(baseline(), timeout=LOAD_TIMEOUT_S)
        self.fresh = True

    def ready(self) -> executor_pb2.ModelInfo:
        """The baseline loaded and serving; its ModelInfo."""
        self.server.ready()
        if not self.fresh:
            self._load_baseline(self.server)
        return model_info(self.server)


@pytest.fixture(scope="module")
def loader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loader]:
    model_root = tmp_path_factory.mktemp("fuzz-model-root")
    write_model_root(model_root)
    loader = Loader(tmp_path_factory.mktemp("fuzz-load"), model_root)
    yield loader
    failure = loader.server.stop()
    assert failure is None, failure


def check_serves(server: FuzzedServer, info: executor_pb2.ModelInfo, context: str) -> None:
    """A one-token prompt gets its token. A prompt that fills the context (or cache) up to max_tokens gets
    exactly max_tokens, or RESOURCE_EXHAUSTED when admission counts the lookahead a drafter needs: it must
    neither stall nor fail (issue 13 item 4, for every method and k)."""
    room = min(info.max_model_len, info.num_kv_blocks * info.block_size)
    one_token = _greedy([0], 1)
    plans = [one_token]
    if EXACT_FILL_MAX_TOKENS < room <= EXACT_FILL_MAX_CONTEXT:
        plans.append(_greedy([0] * (room - EXACT_FILL_MAX_TOKENS), EXACT_FILL_MAX_TOKENS))
    for outcome in run_streams(server, plans):
        check_stream(outcome, info)  # a stall or a failure is reported here
        if outcome.plan is one_token:
            assert outcome.error is None, f"the model LoadModel accepted refuses {one_token!r} {context}"
        elif outcome.error is not None:
            assert outcome.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{outcome.plan!r} {context}"


def _greedy(ids: list[int], max_tokens: int) -> StreamPlan:
    params = executor_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = executor_pb2.GenerateRequest(
        request_id=unique_id("load"), token_ids=executor_pb2.TokenIds(ids=ids), sampling=params
    )
    return StreamPlan(request)


def load(loader: Loader, shown: Shown) -> None:
    before = loader.ready()
    context = f"after LoadModel {shown!r}"
    try:
        answer = stub(loader.server).LoadModel(shown.message, timeout=LOAD_TIMEOUT_S)
    except grpc.RpcError as err:
        check_refusal(err, shown.message, "LoadModel")
        assert health(loader.server) == health_pb2.HealthCheckResponse.SERVING, f"NOT_SERVING {context}"
        assert model_info(loader.server) == before, f"the loaded model changed {context}"
    else:
        loader.fresh = False
        assert answer.info == model_info(loader.server), context
        check_serves(loader.server, answer.info, context)
    settle(loader.server, context)


@given(messages(executor_pb2.LoadModelRequest, LOAD_FIELDS).map(Shown))
def test_load_model_any_request(loader: Loader, shown: Shown) -> None:
    load(loader, shown)


@given(near(st.sampled_from(valid_requests()), LOAD_FIELDS).map(Shown))
def test_load_model_near_valid_request(loader: Loader, shown: Shown) -> None:
    load(loader, shown)


@given(st.binary(max_size=256))
def test_load_model_any_bytes(loader: Loader, payload: bytes) -> None:
    loader.ready()
    assert loader.server.channel is not None
    call = loader.server.channel.unary_unary("/specdec.v1.Executor/LoadModel")
    try:
        call(payload, timeout=LOAD_TIMEOUT_S)
        loader.fresh = False
    except grpc.RpcError as err:
        if not (err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in (err.details() or "")):
            check_refusal(err, executor_pb2.LoadModelRequest.FromString(payload), "LoadModel")
    settle(loader.server, f"after LoadModel bytes {payload!r}")
