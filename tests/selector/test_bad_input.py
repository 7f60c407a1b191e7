"""Bad input: each case is INVALID_ARGUMENT with a BadRequest field violation naming the field."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from builders import cuda, dflash, eagle, layers, request, rocm

from selection.selector import select_backends
from specdec.v1 import common_pb2, selector_pb2
from specdec_runtime.errors import InvalidArgument

Mutation = Callable[[selector_pb2.SelectBackendsRequest], None]


def _set(path: str, value: object) -> Mutation:
    def mutate(req: selector_pb2.SelectBackendsRequest) -> None:
        *parents, leaf = path.split(".")
        message = req
        for name in parents:
            message = getattr(message, name)
        setattr(message, leaf, value)

    return mutate


def _clear(field: str) -> Mutation:
    return lambda req: req.ClearField(field)


def _speculative(spec: common_pb2.SpeculativeConfig) -> Mutation:
    return lambda req: req.speculative.CopyFrom(spec)


def _no_mask_token(req: selector_pb2.SelectBackendsRequest) -> None:
    req.speculative.CopyFrom(dflash())
    req.speculative.dflash_config.ClearField("mask_token_id")


def _no_dflash_config(req: selector_pb2.SelectBackendsRequest) -> None:
    req.speculative.CopyFrom(dflash())
    req.speculative.ClearField("dflash_config")


def _rocm_without_arch(req: selector_pb2.SelectBackendsRequest) -> None:
    req.hardware.CopyFrom(rocm(arch=""))


def _empty_library_name(req: selector_pb2.SelectBackendsRequest) -> None:
    req.hardware.libraries.add(name=" ", version="1.0")


def _dflash_layers(*ids: int) -> Mutation:
    def mutate(req: selector_pb2.SelectBackendsRequest) -> None:
        req.speculative.CopyFrom(dflash())
        req.speculative.dflash_config.target_layer_ids[:] = ids

    return mutate


def _tp_layers(size: int, heads_per_rank: int, kv_heads_per_rank: int) -> Mutation:
    def mutate(req: selector_pb2.SelectBackendsRequest) -> None:
        req.target_layers.tensor_parallel_size = size
        req.target_layers.num_heads_per_rank = heads_per_rank
        req.target_layers.num_kv_heads_per_rank = kv_heads_per_rank

    return mutate


CASES: list[tuple[str, Mutation, str]] = [
    ("missing hardware", _clear("hardware"), "hardware"),
    ("unspecified platform", _set("hardware.platform", 0), "hardware.platform"),
    ("unknown platform", _set("hardware.platform", 7), "hardware.platform"),
    (
        "cuda without compute capability",
        _set("hardware.compute_capability_major", 0),
        "hardware.compute_capability_major",
    ),
    ("negative minor", _set("hardware.compute_capability_minor", -1), "hardware.compute_capability_minor"),
    ("rocm without gfx arch", _rocm_without_arch, "hardware.gcn_arch"),
    ("negative device count", _set("hardware.device_count", -2), "hardware.device_count"),
    ("empty library name", _empty_library_name, "hardware.libraries[3].name"),
    ("missing target layers", _clear("target_layers"), "target_layers"),
    ("zero head size", _set("target_layers.head_size", 0), "target_layers.head_size"),
    ("negative head size", _set("target_layers.head_size", -64), "target_layers.head_size"),
    ("zero heads", _set("target_layers.num_heads", 0), "target_layers.num_heads"),
    ("zero kv heads", _set("target_layers.num_kv_heads", 0), "target_layers.num_kv_heads"),
    ("kv heads not dividing heads", _set("target_layers.num_kv_heads", 5), "target_layers.num_kv_heads"),
    ("negative tensor parallel size", _set("hardware.tensor_parallel_size", -1), "hardware.tensor_parallel_size"),
    ("more ranks than devices", _set("hardware.tensor_parallel_size", 2), "hardware.tensor_parallel_size"),
    ("tp not dividing kv heads", _set("target_layers.tensor_parallel_size", 16), "target_layers.tensor_parallel_size"),
    ("per-rank heads without tp", _set("target_layers.num_heads_per_rank", 16), "target_layers.num_heads_per_rank"),
    ("per-rank kv heads wrong", _tp_layers(2, 16, 8), "target_layers.num_kv_heads_per_rank"),
    ("unspecified dtype", _set("target_layers.dtype", 0), "target_layers.dtype"),
    ("unknown dtype", _set("target_layers.dtype", 9), "target_layers.dtype"),
    ("unknown kv cache dtype", _set("target_layers.kv_cache_dtype", "int3"), "target_layers.kv_cache_dtype"),
    ("negative block size", _set("target_layers.block_size", -16), "target_layers.block_size"),
    ("negative sliding window", _set("target_layers.sliding_window", -1), "target_layers.sliding_window"),
    ("unknown target backend", _set("attention.backend", "FAST_ATTN"), "attention.backend"),
    ("unknown drafter backend", _speculative(eagle(backend="nope")), "speculative.attention_backend"),
    ("unspecified method", _speculative(common_pb2.SpeculativeConfig(num_speculative_tokens=3)), "speculative.method"),
    ("unknown method", _speculative(common_pb2.SpeculativeConfig(method=42)), "speculative.method"),
    ("negative k", _speculative(eagle(k=-1)), "speculative.num_speculative_tokens"),
    ("dflash without config", _no_dflash_config, "speculative.dflash_config.mask_token_id"),
    ("dflash without mask token", _no_mask_token, "speculative.dflash_config.mask_token_id"),
    (
        "dflash negative mask token",
        _set("speculative.dflash_config.mask_token_id", -1),
        "speculative.dflash_config.mask_token_id",
    ),
    ("dflash block of one", _set("speculative.dflash_config.block_size", 1), "speculative.dflash_config.block_size"),
    ("dflash k beyond block", _set("speculative.num_speculative_tokens", 16), "speculative.num_speculative_tokens"),
    ("dflash negative layer", _dflash_layers(1, -3), "speculative.dflash_config.target_layer_ids[1]"),
    ("dflash duplicate layer", _dflash_layers(1, 9, 9), "speculative.dflash_config.target_layer_ids[2]"),
    (
        "dflash config on eagle",
        _speculative(eagle(dflash_config=common_pb2.DFlashConfig(mask_token_id=1))),
        "speculative.dflash_config",
    ),
    ("bad drafter layers", _speculative(eagle(draft_layers=layers(head_size=0))), "speculative.draft_layers.head_size"),
]


def _base() -> selector_pb2.SelectBackendsRequest:
    """A valid request with a DFlash drafter, so the DFlash mutations start from something sound."""
    return request(cuda(9, 0, flash_attn="4.0.0b36"), layers(), speculative=dflash())


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_field(mutate: Mutation, field: str) -> None:
    req = _base()
    select_backends(req)  # valid before the mutation
    mutate(req)
    with pytest.raises(InvalidArgument) as err:
        select_backends(req)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert field in [v.field for v in err.value.field_violations], err.value.field_violations
    assert field in err.value.message


def test_every_violation_is_reported_at_once() -> None:
    req = selector_pb2.SelectBackendsRequest(
        hardware=common_pb2.HardwareCapabilities(platform=common_pb2.PLATFORM_CUDA),
        target_layers=common_pb2.LayerSpec(head_size=-1, num_heads=32, num_kv_heads=6),
        attention=common_pb2.AttentionConfig(backend="bogus"),
        speculative=common_pb2.SpeculativeConfig(method=common_pb2.SPEC_METHOD_DFLASH, num_speculative_tokens=-1),
    )
    with pytest.raises(InvalidArgument) as err:
        select_backends(req)
    assert [v.field for v in err.value.field_violations] == [
        "hardware.compute_capability_major",
        "target_layers.head_size",
        "target_layers.num_kv_heads",
        "target_layers.dtype",
        "attention.backend",
        "speculative.num_speculative_tokens",
        "speculative.dflash_config.mask_token_id",
    ]


def test_status_carries_bad_request_details() -> None:
    from google.rpc import error_details_pb2, status_pb2

    req = _base()
    req.target_layers.head_size = 0
    with pytest.raises(InvalidArgument) as err:
        select_backends(req)
    status = err.value.to_status()
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT
    ((key, raw),) = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    bad_request = error_details_pb2.BadRequest()
    assert status_pb2.Status.FromString(raw).details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "target_layers.head_size"


def test_tensor_parallel_shapes_that_split_into_whole_heads_are_selected() -> None:
    req = _base()
    req.hardware.device_count = 8
    req.hardware.tensor_parallel_size = 8
    req.target_layers.tensor_parallel_size = 8  # 32 / 8 heads over 8 / 8 KV heads per rank
    req.target_layers.num_heads_per_rank, req.target_layers.num_kv_heads_per_rank = 4, 1
    assert select_backends(req).target.backend
    req.target_layers.tensor_parallel_size = 16
    with pytest.raises(InvalidArgument, match=r"16 does not divide num_kv_heads \(8\): each rank needs whole heads"):
        select_backends(req)
