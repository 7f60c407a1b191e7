"""Check a SelectBackendsRequest and turn it into what selection reads: the hardware and one
`StackRequest` per attention stack (the target's, and the drafter's when there is one).

Every bad field is reported at once as a google.rpc.BadRequest field violation (INVALID_ARGUMENT). Sizes
come first: a request with a string or list over its bound (bounds.py) is refused for those alone, before its
values are read, so they are never echoed, logged or cached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kernels.capabilities import KV_CACHE_DTYPES, AttentionNeeds, DType, Hardware, Platform
from selection.draft_tree import has_tree, parse_draft_tree
from selection.registry import UnknownBackendError, normalize_backend_name
from selection.rules import drafter_uses_non_causal, drafter_uses_tree_attention, target_uses_tree_attention
from specdec.v1 import common_pb2, selector_pb2
from specdec_runtime.bounds import largest_message, size_violations
from specdec_runtime.errors import FieldViolation, echo, invalid_fields

PLATFORMS = {
    common_pb2.PLATFORM_CUDA: Platform.CUDA,
    common_pb2.PLATFORM_ROCM: Platform.ROCM,
    common_pb2.PLATFORM_CPU: Platform.CPU,
}
DTYPES = {
    common_pb2.DTYPE_FLOAT16: DType.FLOAT16,
    common_pb2.DTYPE_BFLOAT16: DType.BFLOAT16,
    common_pb2.DTYPE_FLOAT32: DType.FLOAT32,
}
DRAFT_METHODS = (common_pb2.SPEC_METHOD_EAGLE, common_pb2.SPEC_METHOD_EAGLE3, common_pb2.SPEC_METHOD_DFLASH)
# Beyond the defaults of bounds.py (strings of 256 bytes, lists of 64): a drafter reads at most this many
# target layers (a layer id each).
SIZE_LIMITS = {"speculative.dflash_config.target_layer_ids": 1024}
# The selector's message limit: the largest request the bounds allow (about 45 KB), with room for fields a
# newer client may add; anything larger is RESOURCE_EXHAUSTED before it is read.
MAX_REQUEST_BYTES = largest_message(selector_pb2.SelectBackendsRequest, SIZE_LIMITS).ByteSize() + 16 * 1024


@dataclass(frozen=True)
class StackRequest:
    """One attention stack to find a backend for."""

    role: str  # "target" | "drafter"
    needs: AttentionNeeds
    backend: str | None  # the explicitly named backend; None: autoselect
    backend_field: str  # where the name came from, for error details


@dataclass(frozen=True)
class ParsedRequest:
    hardware: Hardware
    target: StackRequest
    drafter: StackRequest | None


def parse_request(request: selector_pb2.SelectBackendsRequest) -> ParsedRequest:
    """The request as selection inputs; raises InvalidArgument listing every bad field."""
    oversized = size_violations(request, SIZE_LIMITS)
    if oversized:
        raise invalid_fields(oversized)
    violations: list[FieldViolation] = []
    hardware = _parse_hardware(request, violations)
    target_needs = None
    if not request.HasField("target_layers"):
        violations.append(FieldViolation("target_layers", "required: the target's attention shape"))
    else:
        target_needs = _parse_layers(
            request.target_layers, "target_layers", request.attention.use_non_causal, violations
        )
    target_backend = _parse_backend_name(request.attention.backend, "attention.backend", violations)
    drafter = _parse_drafter(request, violations)
    if violations:
        raise invalid_fields(violations)
    assert hardware is not None and target_needs is not None
    if drafter is not None and target_uses_tree_attention(request.speculative):  # R11: the target verifies the tree
        target_needs = replace(target_needs, use_tree_attention=True)
    target = StackRequest("target", target_needs, target_backend, "attention.backend")
    return ParsedRequest(hardware, target, drafter)


def _parse_hardware(request: selector_pb2.SelectBackendsRequest, violations: list[FieldViolation]) -> Hardware | None:
    if not request.HasField("hardware"):
        violations.append(FieldViolation("hardware", "required: the machine's capability report"))
        return None
    hw = request.hardware
    platform = PLATFORMS.get(hw.platform)
    if hw.platform == common_pb2.PLATFORM_UNSPECIFIED:
        violations.append(FieldViolation("hardware.platform", "required: PLATFORM_CUDA, PLATFORM_ROCM or PLATFORM_CPU"))
    elif platform is None:
        violations.append(FieldViolation("hardware.platform", f"unknown platform {hw.platform}"))
    if platform is Platform.CUDA and hw.compute_capability_major <= 0:
        violations.append(
            FieldViolation("hardware.compute_capability_major", "required and positive on CUDA (e.g. 9 for H100)")
        )
    if hw.compute_capability_minor < 0:
        violations.append(FieldViolation("hardware.compute_capability_minor", "must not be negative"))
    if platform is Platform.ROCM and not hw.gcn_arch.strip():
        violations.append(FieldViolation("hardware.gcn_arch", "required on ROCm (e.g. gfx942)"))
    if hw.device_count < 0:
        violations.append(FieldViolation("hardware.device_count", "must not be negative"))
    if hw.tensor_parallel_size < 0:
        violations.append(FieldViolation("hardware.tensor_parallel_size", "must not be negative (0 or 1: one device)"))
    elif platform in (Platform.CUDA, Platform.ROCM) and 0 < hw.device_count < hw.tensor_parallel_size:
        violations.append(
            FieldViolation(
                "hardware.tensor_parallel_size",
                f"{hw.tensor_parallel_size} ranks need as many devices; the machine reports {hw.device_count}",
            )
        )
    for i, lib in enumerate(hw.libraries):
        if not lib.name.strip():
            violations.append(FieldViolation(f"hardware.libraries[{i}].name", "must not be empty"))
    if platform is None:
        return None
    return Hardware(
        platform=platform,
        compute_capability=(hw.compute_capability_major, hw.compute_capability_minor),
        gcn_arch=hw.gcn_arch.strip().lower(),
        libraries=tuple((lib.name.strip(), lib.version.strip()) for lib in hw.libraries),
    )


def _parse_layers(
    spec: common_pb2.LayerSpec, prefix: str, use_non_causal: bool, violations: list[FieldViolation]
) -> AttentionNeeds | None:
    start = len(violations)
    for name in ("head_size", "num_heads", "num_kv_heads"):
        if getattr(spec, name) <= 0:
            violations.append(FieldViolation(f"{prefix}.{name}", "required and positive"))
    if spec.num_heads > 0 and spec.num_kv_heads > 0 and spec.num_heads % spec.num_kv_heads:
        violations.append(
            FieldViolation(
                f"{prefix}.num_kv_heads", f"must divide num_heads ({spec.num_heads}) for grouped-query attention"
            )
        )
    _check_tensor_parallel(spec, prefix, violations)
    dtype = DTYPES.get(spec.dtype)
    if spec.dtype == common_pb2.DTYPE_UNSPECIFIED:
        violations.append(FieldViolation(f"{prefix}.dtype", "required: DTYPE_FLOAT16, DTYPE_BFLOAT16 or DTYPE_FLOAT32"))
    elif dtype is None:
        violations.append(FieldViolation(f"{prefix}.dtype", f"unknown dtype {spec.dtype}"))
    kv_cache_dtype = spec.kv_cache_dtype.strip().lower() or "auto"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        violations.append(
            FieldViolation(
                f"{prefix}.kv_cache_dtype", f"{echo(spec.kv_cache_dtype)} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        )
    if spec.block_size < 0:
        violations.append(FieldViolation(f"{prefix}.block_size", "must not be negative (0: the backend's choice)"))
    if spec.sliding_window < 0:
        violations.append(FieldViolation(f"{prefix}.sliding_window", "must not be negative (0: no window)"))
    if len(violations) > start or dtype is None:
        return None
    return AttentionNeeds(
        head_size=spec.head_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=spec.block_size or None,
        use_mla=spec.use_mla,
        has_sink=spec.has_sink,
        has_sliding_window=spec.sliding_window > 0,
        use_non_causal=use_non_causal,
    )


def _check_tensor_parallel(spec: common_pb2.LayerSpec, prefix: str, violations: list[FieldViolation]) -> None:
    """Each rank's kernel runs its share of the heads: whole heads, and per-rank counts (where given) that
    are the model's divided by the ranks."""
    size = spec.tensor_parallel_size
    if size < 0:
        violations.append(FieldViolation(f"{prefix}.tensor_parallel_size", "must not be negative (0 or 1: not split)"))
    for name in ("num_heads", "num_kv_heads"):
        count, per_rank = getattr(spec, name), getattr(spec, f"{name}_per_rank")
        if size <= 1 and per_rank:
            violations.append(FieldViolation(f"{prefix}.{name}_per_rank", "set only with tensor_parallel_size > 1"))
        elif size > 1 and count > 0 and count % size:
            violations.append(
                FieldViolation(
                    f"{prefix}.tensor_parallel_size",
                    f"{size} does not divide {name} ({count}): each rank needs whole heads",
                )
            )
        elif size > 1 and per_rank and per_rank * size != count:
            violations.append(
                FieldViolation(
                    f"{prefix}.{name}_per_rank", f"{per_rank} x tensor_parallel_size {size} is not {name} ({count})"
                )
            )


def _parse_backend_name(name: str, field: str, violations: list[FieldViolation]) -> str | None:
    try:
        return normalize_backend_name(name)
    except UnknownBackendError as err:
        violations.append(FieldViolation(field, str(err)))
        return None


def _parse_drafter(
    request: selector_pb2.SelectBackendsRequest, violations: list[FieldViolation]
) -> StackRequest | None:
    if not request.HasField("speculative"):
        return None
    spec = request.speculative
    if spec.method == common_pb2.SPEC_METHOD_UNSPECIFIED:
        violations.append(FieldViolation("speculative.method", "required (SPEC_METHOD_NONE: no drafter)"))
        return None
    if spec.method == common_pb2.SPEC_METHOD_NONE:
        return None
    if spec.method not in DRAFT_METHODS:
        violations.append(FieldViolation("speculative.method", f"unknown method {spec.method}"))
        return None
    if spec.num_speculative_tokens < 0:
        violations.append(
            FieldViolation("speculative.num_speculative_tokens", "must not be negative (0: the drafter's default)")
        )
    if spec.method == common_pb2.SPEC_METHOD_DFLASH:
        _check_dflash(spec, violations)
    elif spec.HasField("dflash_config"):
        violations.append(FieldViolation("speculative.dflash_config", "only valid with SPEC_METHOD_DFLASH"))
    use_non_causal = drafter_uses_non_causal(spec.method, spec.dflash_config.causal)  # R6
    is_dflash = spec.method == common_pb2.SPEC_METHOD_DFLASH
    k_field = "speculative.num_speculative_tokens"
    violations += parse_draft_tree(spec.tree, is_dflash, spec.num_speculative_tokens, "speculative.tree", k_field)[1]
    backend = _parse_backend_name(spec.attention_backend, "speculative.attention_backend", violations)
    if spec.HasField("draft_layers"):
        needs = _parse_layers(spec.draft_layers, "speculative.draft_layers", use_non_causal, violations)
    else:
        needs = _parse_layers(request.target_layers, "target_layers", use_non_causal, [])
    if needs is None:
        return None
    drafts_tree = drafter_uses_tree_attention(spec.method, has_tree(spec.tree))  # R11: it drafts the tree
    needs = replace(needs, use_tree_attention=drafts_tree)
    # R5: its own needs and its own name (decided apart from the target's in rules.decide_stacks).
    return StackRequest("drafter", needs, backend, "speculative.attention_backend")


def _check_dflash(spec: common_pb2.SpeculativeConfig, violations: list[FieldViolation]) -> None:
    cfg = spec.dflash_config
    prefix = "speculative.dflash_config"
    if not cfg.HasField("mask_token_id"):
        violations.append(
            FieldViolation(f"{prefix}.mask_token_id", "required for DFlash: the token that fills the block")
        )
    elif cfg.mask_token_id < 0:
        violations.append(FieldViolation(f"{prefix}.mask_token_id", "must not be negative"))
    if cfg.block_size < 0 or cfg.block_size == 1:
        violations.append(FieldViolation(f"{prefix}.block_size", "must be at least 2 (0: the checkpoint's)"))
    elif cfg.block_size and spec.num_speculative_tokens > cfg.block_size - 1:
        violations.append(
            FieldViolation(
                "speculative.num_speculative_tokens",
                f"at most block_size - 1 = {cfg.block_size - 1} for DFlash",
            )
        )
    seen: set[int] = set()
    for i, layer in enumerate(cfg.target_layer_ids):
        if layer < 0:
            violations.append(FieldViolation(f"{prefix}.target_layer_ids[{i}]", "must not be negative"))
        elif layer in seen:
            violations.append(FieldViolation(f"{prefix}.target_layer_ids[{i}]", f"duplicate layer {layer}"))
        seen.add(layer)
