"""LoadModel under hostile or mistaken requests (issue 13, items 2, 3 and 5), over gRPC.

A load that fails keeps the model being served; every size is bounded and the memory is estimated before
anything is allocated; a KV cache too small for the warm-up is refused instead of looping forever; SIGTERM
stops an executor that is building a model; odd paths and malformed configs are INVALID_ARGUMENT naming the
field. Tests that could hang on a regression run the executor as a subprocess, with RPC deadlines.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from executor_builders import load_request, tiny_model
from google.protobuf import json_format
from load_refusals import CPU, RPC_TIMEOUT_S, SERVING, assert_still_serving, generate, health, refusal, write_drafter
from rpc_details import violations
from spec_builders import draft_model

import executor_service.server.servicer as servicer_module
from executor_service.models.loader import save_directory
from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2, executor_pb2_grpc

WAIT_S = 60.0


def with_changes(**fields: int) -> executor_pb2.LoadModelRequest:
    request = load_request()
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def with_target(**fields: int) -> executor_pb2.LoadModelRequest:
    request = load_request()
    for name, value in fields.items():
        setattr(request.target.synthetic, name, value)
    return request


def with_dflash_block(block_size: int) -> executor_pb2.LoadModelRequest:
    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 3))
    request.draft.dflash_config.block_size = block_size
    request.draft.num_speculative_tokens = 0  # the default: block_size - 1
    return request


def with_dflash_layers(layers: list[int]) -> executor_pb2.LoadModelRequest:
    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 3))
    request.draft.dflash_config.target_layer_ids.extend(layers)
    return request


def with_drafter_path(path: str) -> executor_pb2.LoadModelRequest:
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    request.draft.source.path = path
    return request


# (case, request, status code, the field named in the details)
OUT_OF_BOUNDS = [
    ("vocab 2^31-1", with_target(vocab_size=2**31 - 1), "INVALID_ARGUMENT", "target.synthetic.vocab_size"),
    ("layers 2^30", with_target(num_layers=2**30), "INVALID_ARGUMENT", "target.synthetic.num_layers"),
    ("hidden 2^30", with_target(hidden_size=2**30), "INVALID_ARGUMENT", "target.synthetic.hidden_size"),
    ("mlp 2^31-1", with_target(intermediate_size=2**31 - 1), "INVALID_ARGUMENT", "target.synthetic.intermediate_size"),
    ("heads 2^20", with_target(num_heads=2**20, num_kv_heads=2**20), "INVALID_ARGUMENT", "target.synthetic.num_heads"),
    ("head 2^30", with_target(head_size=2**30), "INVALID_ARGUMENT", "target.synthetic.head_size"),
    ("block_size 2^30", with_changes(block_size=2**30), "INVALID_ARGUMENT", "block_size"),
    ("num_kv_blocks 2^31-1", with_changes(num_kv_blocks=2**31 - 1), "INVALID_ARGUMENT", "num_kv_blocks"),
    ("DFlash block 2^30", with_dflash_block(2**30), "INVALID_ARGUMENT", "draft.dflash_config.block_size"),
    ("10^5 layer ids", with_dflash_layers([0] * 10**5), "INVALID_ARGUMENT", "draft.dflash_config.target_layer_ids"),
    # Every size within its bound, but about 256 GiB of weights: refused from the estimate, nothing allocated.
    ("256 GiB", with_target(vocab_size=2**20, hidden_size=2**15), "RESOURCE_EXHAUSTED", "target"),
]


async def test_a_load_that_cannot_be_built_keeps_the_served_model(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, tmp_path: Path
) -> None:
    info = (await stub.LoadModel(load_request(), timeout=RPC_TIMEOUT_S)).info
    write_drafter(tmp_path / "bad-drafter")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "bad-drafter" / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :8].contiguous()
    save_file(state, str(tmp_path / "bad-drafter" / "model.safetensors"))
    malformed = ("malformed drafter", with_drafter_path("bad-drafter"), "INVALID_ARGUMENT", "draft.source.path")
    for case, request, code, field in [*OUT_OF_BOUNDS, malformed]:
        err = await refusal(stub, request)
        assert err.code().name == code, (case, err.code(), err.details())
        assert field in violations(err), (case, err.details(), violations(err))
        await assert_still_serving(executor, stub, info, case)
    assert len(await generate(stub, "after", 4)) == 4


async def test_memory_is_estimated_before_allocating(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RESOURCE_EXHAUSTED with the estimate and what is available; a model that fits only in place of the
    loaded one replaces it; what the estimate counts is at least what the session holds."""
    from executor_service.server import memory

    loaded = await stub.LoadModel(load_request(), timeout=RPC_TIMEOUT_S)
    session = executor.servicer.session
    assert session is not None and session.memory is not None
    held = sum(p.numel() * p.element_size() for p in session.loaded.model.parameters())
    held += session.kv_cache.storage.numel() * session.kv_cache.storage.element_size()
    assert session.memory.weights + session.memory.kv_cache >= held

    monkeypatch.setattr(memory, "available_bytes", lambda device, fraction: 1 << 20)
    err = await refusal(stub, load_request(num_kv_blocks=4096))  # 64 MiB more than the loaded model's cache
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "estimate" in err.details() and "1.0 MiB available" in err.details(), err.details()
    await assert_still_serving(executor, stub, loaded.info, "does not fit")

    # Room for one model: it fits once the loaded one is released, so the new one takes its place.
    budget = session.memory.total + (1 << 20)
    monkeypatch.setattr(memory, "available_bytes", lambda device, fraction: budget - session.memory.total)
    replaced = await stub.LoadModel(load_request("qwen3"), timeout=RPC_TIMEOUT_S)
    assert replaced.info.architecture == "qwen3"
    assert await health(executor) == SERVING and len(await generate(stub, "in-place", 3)) == 3


async def test_the_old_model_serves_until_the_new_one_is_ready(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the new session is built, health stays SERVING and Generate runs on the old model; at the swap the
    old model's streams still running end with finish_reason "abort", as when a model is replaced."""
    await stub.LoadModel(load_request(), timeout=RPC_TIMEOUT_S)
    building, release = threading.Event(), threading.Event()
    build = servicer_module.build_session

    def slow_build(*args: object, **kwargs: object) -> object:
        building.set()
        assert release.wait(WAIT_S), "the test never released the build"
        return build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(servicer_module, "build_session", slow_build)
    load = asyncio.ensure_future(stub.LoadModel(load_request("qwen3"), timeout=RPC_TIMEOUT_S))
    try:
        assert await asyncio.to_thread(building.wait, WAIT_S), "the new session was never built"
        assert await health(executor) == SERVING
        assert len(await generate(stub, "during", 3)) == 3
        long = stub.Generate(
            executor_pb2.GenerateRequest(
                request_id="long",
                token_ids=executor_pb2.TokenIds(ids=[4, 5]),
                sampling=executor_pb2.SamplingParams(max_tokens=900),
            ),
            timeout=RPC_TIMEOUT_S,
        )
        assert (await long.read()).token_ids
    finally:
        release.set()
    loaded = await asyncio.wait_for(load, WAIT_S)
    assert loaded.info.architecture == "qwen3"
    last = None
    while (response := await long.read()) is not grpc.aio.EOF:
        last = response
    assert last is not None and last.finished.finish_reason == "abort"
    assert await health(executor) == SERVING and len(await generate(stub, "after", 3)) == 3


def sync_refusal(stub: executor_pb2_grpc.ExecutorStub, request: executor_pb2.LoadModelRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadModel(request, timeout=RPC_TIMEOUT_S)
    return err.value


def test_a_cache_too_small_for_the_warm_up_is_refused(launch_executor: Callable[..., object], tmp_path: Path) -> None:
    """num_kv_blocks 1 or 2 (and a drafter's lookahead on top) used to loop in warm-up forever; a config.json
    that is a FIFO used to block a thread forever. Both are INVALID_ARGUMENT now, and the server serves on."""
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")
    server = launch_executor(None, "--model-root", str(tmp_path))
    dflash = load_request(num_kv_blocks=3)  # 48 tokens: not the 32 + 3 of the warm-up and a block of 16 ahead
    dflash.draft.CopyFrom(draft_model("dflash", 15))
    cases = [(load_request(num_kv_blocks=n), "num_kv_blocks") for n in (1, 2)]
    cases += [(dflash, "num_kv_blocks")]
    cases += [(executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path="fifo")), "target.path")]
    with grpc.insecure_channel(server.address) as channel:  # type: ignore[attr-defined]
        stub = executor_pb2_grpc.ExecutorStub(channel)
        for request, field in cases:
            err = sync_refusal(stub, request)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, err.code(), err.details())
            assert field in violations(err), (err.details(), violations(err))
        assert stub.LoadModel(load_request(num_kv_blocks=3), timeout=RPC_TIMEOUT_S).info.num_kv_blocks == 3


SLOW_TARGET = dict(num_layers=1024)  # tiny widths, many layers: a warm-up of many seconds at one token per step


def slow_load_request() -> executor_pb2.LoadModelRequest:
    request = load_request(num_kv_blocks=4)
    for name, value in SLOW_TARGET.items():
        setattr(request.target.synthetic, name, value)
    return request


def wait_for_log(server: object, text: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while text not in server.log():  # type: ignore[attr-defined]
        assert server.process.poll() is None, server.log()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log()}"  # type: ignore[attr-defined]
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["LoadModel", "--load"])
def test_sigterm_stops_an_executor_that_is_building_a_model(
    launch_executor: Callable[..., object], tmp_path: Path, how: str
) -> None:
    """The build is cancelled: the process exits 0 well before the build would have ended."""
    slow = ("--max-num-batched-tokens", "1")
    if how == "--load":
        load = tmp_path / "load.json"
        load.write_text(json_format.MessageToJson(slow_load_request()))
        server = launch_executor(load, *slow)
        wait_for_log(server, "building the model")
        assert server.stop() == 0, server.shutdown_failure()  # type: ignore[attr-defined]
        return
    server = launch_executor(None, *slow)
    with grpc.insecure_channel(server.address) as channel:  # type: ignore[attr-defined]
        stub = executor_pb2_grpc.ExecutorStub(channel)
        pending = stub.LoadModel.future(slow_load_request(), timeout=RPC_TIMEOUT_S)
        wait_for_log(server, "building the model")
        assert server.stop() == 0, server.shutdown_failure()  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as err:
            pending.result(timeout=RPC_TIMEOUT_S)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err.value.details()


def test_a_cancelled_build_stops_between_tensors(tmp_path: Path) -> None:
    """Shutdown's cancellation reaches the tensor copy loops as LoadCancelled, not as a checkpoint read error."""
    from executor_service.cancellation import LoadCancelled, cancellable
    from executor_service.models.loader import load_directory

    save_directory(tiny_model().model, tmp_path / "target")
    cancel = threading.Event()
    cancel.set()
    with cancellable(cancel), pytest.raises(LoadCancelled):
        load_directory(tmp_path / "target", torch.float32, CPU, "target.path")
    assert load_directory(tmp_path / "target", torch.float32, CPU, "target.path").config.num_layers == 2


def write_target(directory: Path, **config_changes: object) -> None:
    save_directory(tiny_model().model, directory)
    if config_changes:
        raw = json.loads((directory / "config.json").read_text())
        raw.update(config_changes)
        (directory / "config.json").write_text(json.dumps(raw))


def path_request(path: str) -> executor_pb2.LoadModelRequest:
    return executor_pb2.LoadModelRequest(target=executor_pb2.ModelSource(path=path), num_kv_blocks=8)


async def test_odd_paths_and_configs_are_invalid_argument_naming_the_field(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, tmp_path: Path
) -> None:
    info = (await stub.LoadModel(load_request(), timeout=RPC_TIMEOUT_S)).info
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "loop.gguf").symlink_to(tmp_path / "loop.gguf")
    configs = {
        "vocab-text": ({"vocab_size": "512"}, "target.path.vocab_size"),
        "vocab-bool": ({"vocab_size": True}, "target.path.vocab_size"),
        "kv-heads-text": ({"num_key_value_heads": "2"}, "target.path.num_key_value_heads"),
        "kv-heads-3": ({"num_key_value_heads": 3}, "target.path.num_key_value_heads"),
        "head-dim-text": ({"head_dim": [32]}, "target.path.head_dim"),
        "positions-huge": ({"max_position_embeddings": 10**30}, "target.path.max_position_embeddings"),
        "theta-text": ({"rope_theta": "fast"}, "target.path.rope_theta"),
        "eps-text": ({"rms_norm_eps": "small"}, "target.path.rms_norm_eps"),
        "rope-text": ({"rope_scaling": "linear"}, "target.path.rope_scaling"),
        "llama3-partial": ({"rope_scaling": {"rope_type": "llama3"}}, "target.path.rope_scaling.factor"),
        "eos-text": ({"eos_token_id": "</s>"}, "target.path.eos_token_id"),
        "eos-outside": ({"eos_token_id": [1, 10**6]}, "target.path.eos_token_id"),
        "architectures-number": ({"architectures": 7}, "target.path.architectures"),
    }
    for name, (changes, _) in configs.items():
        write_target(tmp_path / name, **changes)
    write_target(tmp_path / "list-config")
    (tmp_path / "list-config" / "config.json").write_text("[1, 2]")
    write_target(tmp_path / "dir-config")
    (tmp_path / "dir-config" / "config.json").unlink()
    (tmp_path / "dir-config" / "config.json").mkdir()
    write_target(tmp_path / "generation-json", eos_token_id=None)
    (tmp_path / "generation-json" / "generation_config.json").write_text("{not json")
    write_target(tmp_path / "generation-eos", eos_token_id=None)
    (tmp_path / "generation-eos" / "generation_config.json").write_text('{"eos_token_id": {"id": 2}}')
    write_target(tmp_path / "generation-list", eos_token_id=None)
    (tmp_path / "generation-list" / "generation_config.json").write_text("[2]")
    write_drafter(tmp_path / "drafter-text")
    raw = json.loads((tmp_path / "drafter-text" / "config.json").read_text())
    raw.update(hidden_size="64", draft_vocab_size="half", eagle_config={"eagle_aux_hidden_state_layer_ids": ["a"]})
    (tmp_path / "drafter-text" / "config.json").write_text(json.dumps(raw))
    write_drafter(tmp_path / "dflash-text", "dflash")
    raw = json.loads((tmp_path / "dflash-text" / "config.json").read_text())
    raw.update(block_size="16", dflash_config="x")
    (tmp_path / "dflash-text" / "config.json").write_text(json.dumps(raw))
    dflash = with_drafter_path("dflash-text")
    dflash.draft.CopyFrom(draft_model("dflash", 3))
    dflash.draft.source.path = "dflash-text"
    dflash.draft.ClearField("dflash_config")

    cases: list[tuple[executor_pb2.LoadModelRequest, set[str]]] = [
        (path_request("a\0b"), {"target.path"}),
        (path_request("x" * 256), {"target.path"}),
        (path_request("x" * 251 + ".gguf"), {"target.path"}),
        (path_request("a\0b.gguf"), {"target.path"}),
        (path_request("loop-a"), {"target.path"}),
        (path_request("loop.gguf"), {"target.path"}),
        (path_request("list-config"), {"target.path"}),
        (path_request("dir-config"), {"target.path"}),
        (path_request("generation-json"), {"target.path"}),
        (path_request("generation-eos"), {"target.path.eos_token_id"}),
        (path_request("generation-list"), {"target.path"}),
        *[(path_request(name), {field}) for name, (_, field) in configs.items()],
        (with_drafter_path("a\0b"), {"draft.source.path"}),
        (with_drafter_path("y" * 256), {"draft.source.path"}),
        (with_drafter_path("loop-a"), {"draft.source.path"}),
        (
            with_drafter_path("drafter-text"),
            {
                "draft.source.path.hidden_size",
                "draft.source.path.draft_vocab_size",
                "draft.source.path.eagle_config.eagle_aux_hidden_state_layer_ids",
            },
        ),
        (dflash, {"draft.source.path.block_size", "draft.source.path.dflash_config"}),
    ]
    for request, fields in cases:
        err = await refusal(stub, request)
        case = json_format.MessageToJson(request)[:300]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.code(), err.details())
        assert fields <= set(violations(err)), (case, err.details(), violations(err))
    await assert_still_serving(executor, stub, info, "odd paths")
