"""The selection rules R1-R11 (defined in docs/selection.md), gathered here: the ones selection applies are
written in this module; the others are named with where they live.

- R1 backends declare what they serve; one `validate` gives every refusal, in one vocabulary:
  kernels/capabilities.py, `BackendCapability.validate` (called by `decide`).
- R2 a named backend is used or refused, never replaced: `decide`, explicit branch.
- R3 auto-selection walks the priority list and reports every candidate: `decide`, auto branch.
- R4 each platform has its own priority order: `PRIORITIES`, `priority_list`.
- R5 the drafter's backend is its own decision: `decide_stacks` (a separate `decide` on the drafter's needs).
- R6 DFlash drafters are non-causal unless configured causal: `drafter_uses_non_causal`.
- R7 non-causal support is declared per backend, R8 a backend whose library is missing is invalid:
  kernels/capabilities.py (`supports_non_causal`, `required_library`), checked by `validate`.
- R9 causality is chosen per call and checked at run time: kernels/attention.py `check_claimed`, and
  executor_service/server/drafting.py `check_drafter_backend` at load time.
- R10 every draft pass gets fresh attention metadata: executor_service/spec_decode/proposer.py.
- R11 tree drafting needs tree attention, for the target (it verifies the tree) and for an EAGLE / EAGLE-3
  drafter (its passes expand the tree's nodes): `target_uses_tree_attention`, `drafter_uses_tree_attention`;
  declared per backend (kernels/capabilities.py `supports_tree_attention`), checked by `validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels.capabilities import BACKENDS, AttentionNeeds, Hardware, Platform
from selection.draft_tree import has_tree
from specdec.v1 import common_pb2, selector_pb2
from specdec_runtime.errors import FailedPrecondition, FieldViolation, InvalidArgument, PreconditionViolation

if TYPE_CHECKING:  # request.py imports this module for R6
    from selection.request import ParsedRequest, StackRequest


# ---- R4: the order auto-selection tries, per platform --------------------------------------------------------
@dataclass(frozen=True)
class PlatformPriority:
    platform: Platform
    condition: str
    backends: tuple[str, ...]


_CUDA_DEFAULT = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
_CUDA_SM10X_CAUSAL = ("FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
_ROCM = ("ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN", "TRITON_ATTN")
_CPU = ("CPU_ATTN",)

PRIORITIES: tuple[PlatformPriority, ...] = (
    PlatformPriority(Platform.CUDA, "compute capability 10.x, causal", _CUDA_SM10X_CAUSAL),
    # FlashInfer's non-causal (cutlass) path is known to misbehave for DFlash: FLASH_ATTN goes first.
    PlatformPriority(Platform.CUDA, "any other compute capability, or 10.x non-causal", _CUDA_DEFAULT),
    PlatformPriority(Platform.ROCM, "always", _ROCM),
    PlatformPriority(Platform.CPU, "always", _CPU),
)


def priority_list(hardware: Hardware, use_non_causal: bool) -> tuple[str, ...]:
    """The backends auto-selection tries, best first (R4)."""
    if hardware.platform is Platform.CUDA:
        if hardware.compute_capability[0] == 10 and not use_non_causal:
            return _CUDA_SM10X_CAUSAL
        return _CUDA_DEFAULT
    if hardware.platform is Platform.ROCM:
        return _ROCM
    return _CPU


# ---- R6: the drafter's causality ------------------------------------------------------------------------------
def drafter_uses_non_causal(method: int, dflash_causal: bool) -> bool:
    """R6: DFlash proposes its block in one non-causal pass unless the checkpoint says causal; EAGLE drafters
    run one token per step and are causal."""
    return method == common_pb2.SPEC_METHOD_DFLASH and not dflash_causal


# ---- R11: tree drafting ------------------------------------------------------------------------------------
def target_uses_tree_attention(spec: common_pb2.SpeculativeConfig) -> bool:
    """R11: the target verifies a tree of drafts with a mask per token (each draft sees the context and its
    ancestors), whichever drafter drafted it."""
    return spec.method != common_pb2.SPEC_METHOD_NONE and has_tree(spec.tree)


def drafter_uses_tree_attention(method: int, drafts_tree: bool) -> bool:
    """R11: an EAGLE or EAGLE-3 drafter expands the tree's nodes with the same masks. DFlash drafts every depth
    in its one block pass (the block's own attention) and needs none. Also checked at load time
    (executor_service/server/drafting.py)."""
    return drafts_tree and method in (common_pb2.SPEC_METHOD_EAGLE, common_pb2.SPEC_METHOD_EAGLE3)


# ---- R1, R2, R3, R5: one decision per attention stack ---------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    backend: str
    explicit: bool
    use_non_causal: bool
    candidates: tuple[tuple[str, tuple[str, ...]], ...]  # (backend, reasons), in priority order
    use_tree_attention: bool = False

    def to_proto(self) -> common_pb2.BackendDecision:
        return common_pb2.BackendDecision(
            backend=self.backend,
            explicit=self.explicit,
            use_non_causal=self.use_non_causal,
            use_tree_attention=self.use_tree_attention,
            candidates=[
                common_pb2.CandidateVerdict(backend=name, reasons=reasons) for name, reasons in self.candidates
            ],
        )


def decide(hardware: Hardware, stack: StackRequest) -> Decision:
    """The backend for one attention stack, or an error that says why there is none."""
    needs = stack.needs
    if stack.backend is not None:  # R2: validated (R1) and used, never a silent fallback
        reasons = tuple(BACKENDS[stack.backend].validate(needs, hardware))
        if reasons:
            message = f"Selected backend {stack.backend} is not valid for this configuration. Reason: {list(reasons)}"
            violation = FieldViolation(
                stack.backend_field, f"{stack.backend} cannot serve the {stack.role}: {list(reasons)}"
            )
            raise InvalidArgument(message, field_violations=(violation,))
        return Decision(stack.backend, True, needs.use_non_causal, ((stack.backend, ()),), needs.use_tree_attention)
    # R3: every candidate of the priority list (R4) is validated and reported; the first valid one wins.
    candidates = tuple(
        (name, tuple(BACKENDS[name].validate(needs, hardware)))
        for name in priority_list(hardware, needs.use_non_causal)
    )
    for name, reasons in candidates:
        if not reasons:
            return Decision(name, False, needs.use_non_causal, candidates, needs.use_tree_attention)
    rendered = ", ".join(f"{name}: [{', '.join(reasons)}]" for name, reasons in candidates)
    raise FailedPrecondition(
        f"No valid attention backend found for {describe_device(hardware)} with {describe_needs(stack.role, needs)}. "
        f"Reasons: {{{rendered}}}.",
        precondition_violations=tuple(
            PreconditionViolation("BACKEND", name, "; ".join(reasons)) for name, reasons in candidates
        ),
    )


def decide_stacks(parsed: ParsedRequest) -> selector_pb2.SelectBackendsResponse:
    """The target's decision and, when there is a drafter, its own (R5: its needs and name, never the
    target's backend)."""
    response = selector_pb2.SelectBackendsResponse(target=decide(parsed.hardware, parsed.target).to_proto())
    if parsed.drafter is not None:
        response.drafter.CopyFrom(decide(parsed.hardware, parsed.drafter).to_proto())
    return response


def describe_device(hardware: Hardware) -> str:
    if hardware.platform is Platform.CUDA:
        major, minor = hardware.compute_capability
        return f"cuda (compute capability {major}.{minor})"
    if hardware.platform is Platform.ROCM:
        return f"rocm ({hardware.gcn_arch})"
    return "cpu"


def describe_needs(role: str, needs: AttentionNeeds) -> str:
    block = needs.block_size if needs.block_size is not None else "auto"
    return (
        f"AttentionSelectorConfig(role={role}, head_size={needs.head_size}, dtype={needs.dtype.value}, "
        f"kv_cache_dtype={needs.kv_cache_dtype}, block_size={block}, use_mla={needs.use_mla}, "
        f"has_sink={needs.has_sink}, has_sliding_window={needs.has_sliding_window}, "
        f"use_non_causal={needs.use_non_causal}, use_tree_attention={needs.use_tree_attention})"
    )
