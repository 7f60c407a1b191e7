"""Human-readable tables for selection decisions, the capability table and rich gRPC errors."""

from __future__ import annotations

from google.protobuf import any_pb2
from google.rpc import error_details_pb2

from specdec.v1 import common_pb2, selector_pb2


def decision_traits(decision: common_pb2.BackendDecision) -> str:
    """How the backend was chosen and what it was asked for: "auto, causal", "explicit, non-causal, tree attention"."""
    traits = ["explicit" if decision.explicit else "auto", "non-causal" if decision.use_non_causal else "causal"]
    if decision.use_tree_attention:
        traits.append("tree attention")
    return ", ".join(traits)


def render_decision(role: str, decision: common_pb2.BackendDecision) -> str:
    lines = [f"{role}: {decision.backend}  ({decision_traits(decision)})"]
    width = max([len(c.backend) for c in decision.candidates] + [7])
    lines.append(f"  {'#':>2}  {'backend':<{width}}  verdict")
    for i, candidate in enumerate(decision.candidates, 1):
        verdict = "; ".join(candidate.reasons) if candidate.reasons else "ok"
        marker = "  <- selected" if candidate.backend == decision.backend else ""
        lines.append(f"  {i:>2}  {candidate.backend:<{width}}  {verdict}{marker}")
    return "\n".join(lines)


def render_selection(response: selector_pb2.SelectBackendsResponse) -> str:
    parts = [render_decision("target", response.target)]
    if response.HasField("drafter"):
        parts.append(render_decision("drafter", response.drafter))
    else:
        parts.append("drafter: none (no speculative decoding)")
    return "\n\n".join(parts)


def render_backends(response: selector_pb2.ListBackendsResponse) -> str:
    rows = [("backend", "platforms", "dtypes", "heads", "blocks", "non-causal", "sinks", "library")]
    for b in response.backends:
        rows.append(
            (
                b.name,
                ",".join(common_pb2.Platform.Name(p).removeprefix("PLATFORM_").lower() for p in b.platforms),
                ",".join(_short_dtype(d) for d in b.dtypes),
                _size_rule(b.head_sizes),
                _size_rule(b.block_sizes),
                "yes" if b.supports_non_causal else "no",
                "yes" if b.supports_sink else "no",
                b.required_library,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append("")
    for p in response.priorities:
        platform = common_pb2.Platform.Name(p.platform).removeprefix("PLATFORM_").lower()
        lines.append(f"auto order, {platform} ({p.condition}): {' > '.join(p.backends)}")
    return "\n".join(lines)


def render_error(code_name: str, message: str, details: list[any_pb2.Any]) -> str:
    """A status and its google.rpc details (BadRequest, PreconditionFailure) as readable lines."""
    lines = [f"error: {code_name}: {message}"]
    for detail in details:
        bad_request = error_details_pb2.BadRequest()
        failure = error_details_pb2.PreconditionFailure()
        if detail.Unpack(bad_request):
            lines += [f"  field {v.field}: {v.description}" for v in bad_request.field_violations]
        elif detail.Unpack(failure):
            lines += [f"  {v.subject}: {v.description}" for v in failure.violations]
    return "\n".join(lines)


def _short_dtype(dtype: int) -> str:
    return {common_pb2.DTYPE_FLOAT16: "fp16", common_pb2.DTYPE_BFLOAT16: "bf16", common_pb2.DTYPE_FLOAT32: "fp32"}[
        dtype
    ]


def _size_rule(rule: selector_pb2.SizeRule) -> str:
    if rule.allowed:
        return "|".join(str(n) for n in rule.allowed)
    text = f"%{rule.multiple_of}" if rule.multiple_of > 1 else "any"
    if rule.minimum > 1:
        text += f" >={rule.minimum}"
    if rule.maximum:
        text += f" <={rule.maximum}"
    return text
