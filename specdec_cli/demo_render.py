"""What `specdec demo` prints about the executor, the loaded model and a generation's statistics.

Selection decisions are printed by `render.render_decision` (every candidate with its reasons); these are
the other sections, kept apart so the flow in demo.py reads as the sequence of calls it makes.
"""

from __future__ import annotations

from specdec.v1 import common_pb2, executor_pb2
from specdec_cli.render import decision_traits

GiB = 1 << 30


def enum_name(enum: object, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix)  # type: ignore[attr-defined]


def render_capabilities(hardware: common_pb2.HardwareCapabilities) -> str:
    platform = enum_name(common_pb2.Platform, hardware.platform, "PLATFORM_")
    line = f"platform {platform}, device {hardware.device_name or '?'}"
    if hardware.platform == common_pb2.PLATFORM_CUDA:
        line += f" (sm_{hardware.compute_capability_major}{hardware.compute_capability_minor})"
    elif hardware.platform == common_pb2.PLATFORM_ROCM:
        line += f" ({hardware.gcn_arch})"
    line += f", {hardware.device_count} device(s), {hardware.total_memory_bytes / GiB:.1f} GiB"
    libraries = ", ".join(f"{lib.name} {lib.version}" for lib in hardware.libraries) or "none"
    return f"{line}\nkernel libraries: {libraries}"


def render_loaded(
    response: executor_pb2.LoadModelResponse | executor_pb2.GetModelInfoResponse, seconds: float | None
) -> str:
    """A LoadModel's outcome, or (seconds None) the model an executor already serves."""
    info = response.info
    dtype = enum_name(common_pb2.DType, info.dtype, "DTYPE_").lower()
    tree = response.target_backend.use_tree_attention  # the target verifies trees (R11)
    drafts = f"a tree of {info.num_speculative_tokens} drafts" if tree else f"{info.num_speculative_tokens} tokens"
    lines = [
        f"{f'loaded in {seconds:.1f} s' if seconds is not None else 'serving'}: target on "
        f"{_backend(response.target_backend)}, drafter on {_backend(response.draft_backend)}",
        f"{dtype}, context {info.max_model_len} tokens, KV cache {info.num_kv_blocks} blocks of {info.block_size}, "
        f"{enum_name(common_pb2.SpecMethod, info.spec_method, 'SPEC_METHOD_')} proposing {drafts} per step, "
        f"tokenizer: {'yes' if info.has_tokenizer else 'none'}",
    ]
    return "\n".join(lines)


def _backend(decision: common_pb2.BackendDecision) -> str:
    return f"{decision.backend} ({decision_traits(decision)})"


def render_finished(finished: executor_pb2.Finished, seconds: float) -> str:
    rate = finished.completion_tokens / seconds if seconds > 0 else 0.0
    share = f" ({100 * finished.accepted_tokens / finished.drafted_tokens:.1f} %)" if finished.drafted_tokens else ""
    per_position = "  ".join(f"{i}: {value:.2f}" for i, value in enumerate(finished.acceptance_rate_per_position, 1))
    return "\n".join(
        [
            f"finish reason {finished.finish_reason}: {finished.prompt_tokens} prompt tokens, "
            f"{finished.completion_tokens} generated in {seconds:.2f} s ({tokens_per_second(rate)} tokens/s)",
            f"drafted {finished.drafted_tokens}, accepted {finished.accepted_tokens}{share}",
            f"mean acceptance length {finished.mean_acceptance_length:.2f} tokens per target verify step",
            f"acceptance rate per draft position: {per_position or 'none (nothing drafted)'}",
        ]
    )


def tokens_per_second(rate: float) -> str:
    """Whole numbers from 10 up, two significant digits below: 0.4 tokens/s printed as "0" before."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"
