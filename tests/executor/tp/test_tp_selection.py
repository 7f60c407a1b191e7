"""At tensor-parallel size N the capability report and the selector's request carry N and the heads each
rank's kernel runs; a target whose heads do not split is refused before anything is loaded."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from tp_greedy_run import METHODS, load_request, select_forced

from executor_service.engine.kv_cache import bytes_per_block
from executor_service.models.weights import hf_layout
from executor_service.parallel import state
from executor_service.server.capabilities import probe
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, prepare_load, selection_request
from executor_service.server.wire import resolve_target
from selection.selector import select_backends
from specdec.v1 import common_pb2
from specdec_runtime.errors import InvalidArgument

CPU = torch.device("cpu")
# The GPU host's report (test_tp_gpu runs there), by hand: the CUDA side of the capability table.
H100 = common_pb2.HardwareCapabilities(
    platform=common_pb2.PLATFORM_CUDA,
    device_name="NVIDIA H100 80GB HBM3",
    compute_capability_major=9,
    compute_capability_minor=0,
    device_count=4,
    libraries=[
        common_pb2.KernelLibrary(name="torch", version="2.11.0"),
        common_pb2.KernelLibrary(name="triton", version="3.6.0"),
    ],
)


@pytest.fixture
def tensor_parallel(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """This process as rank 0 of a group of `size` (no collectives run in these tests)."""

    def set_size(size: int) -> None:
        monkeypatch.setattr(state, "_group", state.TensorParallelGroup(0, size, CPU))

    return set_size


def test_report_and_request_carry_the_ranks_and_per_rank_heads(tensor_parallel: Callable[[int], None]) -> None:
    tensor_parallel(4)
    hardware = probe(CPU)
    assert hardware.tensor_parallel_size == 4
    request = load_request("none")
    source = resolve_target(request.target, None, "target")
    selection = selection_request(request, source.config, hardware, torch.float32)
    layers = selection.target_layers
    assert (layers.num_heads, layers.num_kv_heads) == (8, 4)  # the model's
    assert (layers.tensor_parallel_size, layers.num_heads_per_rank, layers.num_kv_heads_per_rank) == (4, 2, 1)
    assert select_backends(selection).target.backend == "CPU_ATTN"


def test_heads_that_do_not_split_are_refused_naming_the_flag(tensor_parallel: Callable[[int], None]) -> None:
    tensor_parallel(8)
    request = load_request("none")
    source = resolve_target(request.target, None, "target")
    with pytest.raises(InvalidArgument) as refused:
        prepare_load(source, request, None, CPU, EngineSettings())
    descriptions = [v.description for v in refused.value.field_violations]
    assert [v.field for v in refused.value.field_violations] == ["target"]
    assert descriptions == [
        "the target's 4 KV heads do not divide by --tensor-parallel-size 8: each rank needs whole ones"
    ]
    selection = selection_request(request, source.config, probe(CPU), torch.float32)
    assert not selection.target_layers.num_kv_heads_per_rank
    with pytest.raises(InvalidArgument, match="8 does not divide num_kv_heads"):
        select_backends(selection)


def test_one_rank_sends_no_tensor_parallel_fields() -> None:
    request = load_request("none")
    source = resolve_target(request.target, None, "target")
    selection = selection_request(request, source.config, probe(CPU), torch.float32)
    assert selection.hardware.tensor_parallel_size == 1
    assert selection.target_layers.tensor_parallel_size == 0


@pytest.mark.parametrize("size", ["0", "65"])
def test_a_bad_flag_stops_the_executor_naming_it(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    from executor_service.server.main import main
    from specdec_runtime.grpc_runtime import EXIT_BAD_SETUP

    assert main(["--device", "cpu", "--port", "0", "--tensor-parallel-size", size]) == EXIT_BAD_SETUP
    assert f"cannot serve: --tensor-parallel-size must be between 1 and 64, not {size}" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_load_is_checked_against_rank_zeros_share(method: str, tensor_parallel: Callable[[int], None]) -> None:
    """Half the target's weights and KV cache at TP 2, plus the drafter's whole heads: a target twice a
    device's size is not refused for being whole."""
    request = load_request(method)
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None) if method != "none" else None
    whole = prepare_load(source, request, draft, CPU, EngineSettings())
    tensor_parallel(2)
    share = prepare_load(source, request, draft, CPU, EngineSettings())
    config = source.config
    target = sum(math.prod(p.shape) for p in hf_layout(config).values()) * 4
    heads = 2 * config.vocab_size * config.hidden_size * 4 if draft is not None else 0
    assert share.weights == whole.weights - target // 2 + heads
    target_cache = request.num_kv_blocks * bytes_per_block(config, request.block_size, torch.float32)
    assert share.kv_cache == whole.kv_cache - target_cache // 2
    assert share.activations == whole.activations


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("method", list(METHODS))
def test_the_gpu_tests_shapes_run_on_triton_attn_on_cuda(
    method: str, tp: int, tensor_parallel: Callable[[int], None]
) -> None:
    """test_tp_gpu forces TRITON_ATTN on CUDA for the target and every drafter, at TP 1, 2 and 4: the CUDA
    table claims those shapes (heads of 16 were refused there at the first step: the test had bypassed selection)."""
    if tp > 1:
        tensor_parallel(tp)
    request = load_request(method)
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None) if method != "none" else None
    decision = select_forced(request, source, draft, H100, "TRITON_ATTN")
    assert decision.target.backend == "TRITON_ATTN"
    assert decision.drafter.backend == ("TRITON_ATTN" if draft is not None else "")


def test_a_forced_backend_that_refuses_the_heads_fails_the_load_naming_it() -> None:
    """What LoadModel does with a backend its table refuses on this hardware: INVALID_ARGUMENT before anything
    is loaded, naming attention.backend and the reason, instead of a session whose every step fails."""
    request = load_request("none")
    request.target.synthetic.head_size = 16
    source = resolve_target(request.target, None, "target")
    with pytest.raises(InvalidArgument) as refused:
        select_forced(request, source, None, H100, "TRITON_ATTN")
    (violation,) = refused.value.field_violations
    assert violation.field == "attention.backend"
    assert "head_size not supported" in violation.description
