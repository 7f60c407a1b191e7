"""The capability table as the ListBackends answer: kernels.capabilities rendered onto the wire."""

from __future__ import annotations

from kernels.capabilities import BACKENDS, BackendCapability, SizeRule, reason_vocabulary
from selection.request import DTYPES, PLATFORMS
from selection.rules import PRIORITIES
from specdec.v1 import common_pb2, selector_pb2

PLATFORM_TO_PROTO = {platform: value for value, platform in PLATFORMS.items()}
DTYPE_TO_PROTO = {dtype: value for value, dtype in DTYPES.items()}


def list_backends(request: selector_pb2.ListBackendsRequest) -> selector_pb2.ListBackendsResponse:
    """Every backend (of one platform, if the request names one), the priority lists and the reasons."""
    wanted = request.platform
    response = selector_pb2.ListBackendsResponse(reason_vocabulary=reason_vocabulary())
    for cap in BACKENDS.values():
        if wanted == common_pb2.PLATFORM_UNSPECIFIED or wanted in (PLATFORM_TO_PROTO[p] for p in cap.platforms):
            response.backends.append(_capability_to_proto(cap))
    for priority in PRIORITIES:
        if wanted in (common_pb2.PLATFORM_UNSPECIFIED, PLATFORM_TO_PROTO[priority.platform]):
            response.priorities.append(
                selector_pb2.PlatformPriority(
                    platform=PLATFORM_TO_PROTO[priority.platform],
                    condition=priority.condition,
                    backends=priority.backends,
                )
            )
    return response


def _capability_to_proto(cap: BackendCapability) -> selector_pb2.BackendCapabilities:
    lo, hi = cap.compute_capability
    return selector_pb2.BackendCapabilities(
        name=cap.name,
        description=cap.description,
        platforms=[PLATFORM_TO_PROTO[p] for p in cap.platforms],
        dtypes=[DTYPE_TO_PROTO[d] for d in cap.dtypes],
        kv_cache_dtypes=cap.kv_cache_dtypes,
        head_sizes=_size_rule(cap.head_sizes),
        block_sizes=_size_rule(cap.block_sizes),
        compute_capability=selector_pb2.ComputeCapabilityRange(minimum=lo, maximum=hi),
        gcn_archs=cap.gcn_archs,
        supports_mla=cap.supports_mla,
        supports_sink=cap.supports_sink,
        supports_sliding_window=cap.supports_sliding_window,
        supports_non_causal=cap.supports_non_causal,
        required_library=cap.required_library,
        notes=cap.notes,
    )


def _size_rule(rule: SizeRule) -> selector_pb2.SizeRule:
    return selector_pb2.SizeRule(
        allowed=rule.allowed, multiple_of=rule.multiple_of, minimum=rule.minimum, maximum=rule.maximum
    )
