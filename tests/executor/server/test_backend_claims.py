"""build_session checks the backends it is given against the kernels' table before it loads anything: a
decision that did not come from selection (test_tp_gpu's heads of 16 on TRITON_ATTN) fails at once, naming the
field that picks the backend, instead of failing every step of the warm-up."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from executor_builders import load_request
from spec_builders import draft_model

from executor_service.server import session as session_module
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, build_session
from executor_service.server.wire import resolve_target
from specdec.v1 import common_pb2, executor_pb2
from specdec_runtime.errors import FailedPrecondition

LOADED = "the target was loaded"


def build(request: executor_pb2.LoadModelRequest, backend: str, draft_backend: str = "") -> None:
    """build_session with these decisions, on the CPU; the target's loading raises AssertionError(LOADED)."""
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None) if request.HasField("draft") else None
    draft_decision = common_pb2.BackendDecision(backend=draft_backend) if draft is not None else None
    decision = common_pb2.BackendDecision(backend=backend)
    with mock.patch.object(session_module, "load_target", side_effect=AssertionError(LOADED)):
        build_session(
            source, request, decision, torch.device("cpu"), EngineSettings(48, 8), start=False, draft=draft,
            draft_decision=draft_decision,
        )  # fmt: skip


def test_target_heads_the_backend_refuses_fail_before_loading() -> None:
    request = load_request()
    request.target.synthetic.head_size = 16
    with pytest.raises(FailedPrecondition) as refused:
        build(request, "TRITON_ATTN")
    (violation,) = refused.value.field_violations
    assert violation.field == "attention.backend"
    assert "TRITON_ATTN cannot serve the target (heads of 16, float32, KV blocks of 16)" in violation.description
    assert "head_size not supported" in violation.description


def test_drafter_heads_the_backend_refuses_fail_naming_the_drafters_field() -> None:
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 2))
    request.draft.source.synthetic.head_size = 16
    with pytest.raises(FailedPrecondition) as refused:
        build(request, "CPU_ATTN", "TRITON_ATTN")
    (violation,) = refused.value.field_violations
    assert violation.field == "draft.attention_backend"
    assert "cannot serve the drafter (heads of 16" in violation.description


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "CPU_ATTN", "FLEX_ATTENTION"])
def test_claimed_shapes_go_on_to_load(backend: str) -> None:
    request = load_request()
    request.target.synthetic.head_size = 32 if backend == "TRITON_ATTN" else 16
    request.draft.CopyFrom(draft_model("eagle3", 2))
    with pytest.raises(AssertionError, match=LOADED):
        build(request, backend, backend)
