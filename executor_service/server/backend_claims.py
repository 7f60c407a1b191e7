"""The backends a session is built with, checked against the kernels' own capability table before anything loads.

LoadModel's backends come from selection, which reads the same table, so there the check passes. It is for
decisions that did not come from this executor's selection: a remote selector of another version, or a caller
of build_session with its own decision (benchmarks, tests). A backend that the kernels would refuse at every
step (heads of 16 on TRITON_ATTN, say) fails the load at once with the table's reasons, naming the field that
picks the backend, instead of at warm-up with a step's error. Availability (a library missing, the wrong
device) stays the kernels' business: warm-up reports it.
"""

from __future__ import annotations

import torch

from executor_service.models.config import ModelConfig
from kernels.attention import BackendUnavailableError, layer_refusal_reasons
from specdec_runtime.errors import FailedPrecondition, FieldViolation

TARGET_FIELD = "attention.backend"
DRAFT_FIELD = "draft.attention_backend"


def check_backend_claims(
    backend: str, model: ModelConfig, dtype: torch.dtype, block_size: int, device: torch.device, field: str
) -> None:
    """FailedPrecondition naming `field` unless `backend`'s table entry claims `model`'s attention layers (head
    size, dtype, KV block size) on `device`. The stack's own needs (non-causal DFlash, trees) are checked by the
    selector and drafting.check_drafter_backend."""
    try:
        reasons = layer_refusal_reasons(backend, dtype, model.head_size, block_size, device)
    except BackendUnavailableError:
        return
    if reasons:
        stack = "the drafter" if field == DRAFT_FIELD else "the target"
        shape = f"heads of {model.head_size}, {str(dtype).removeprefix('torch.')}, KV blocks of {block_size}"
        description = f"{backend[:64]} cannot serve {stack} ({shape}) on {device.type}: {reasons}"
        raise FailedPrecondition(description, field_violations=(FieldViolation(field, description),))
