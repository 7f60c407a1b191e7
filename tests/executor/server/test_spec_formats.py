"""Drafters in their published checkpoint formats, over gRPC, and refused clearly when they cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_driving import Collector, add_all
from executor_builders import greedy, load_request
from greedy_reference import greedy_reference
from spec_builders import draft_model, spec_session

from executor_service.errors import InvalidField
from executor_service.models.draft_config import default_eagle3_layers
from executor_service.models.draft_weights import save_drafter
from executor_service.server.drafting import check_drafter_backend, resolve_draft
from executor_service.server.session import EngineSettings, build_session
from executor_service.server.wire import resolve_target, status_error
from specdec.v1 import common_pb2, executor_pb2
from specdec_runtime.errors import FailedPrecondition, InvalidArgument

CPU = torch.device("cpu")
EXPECTED_TENSORS = {
    "eagle": {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight"},
    "eagle3": {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight", "d2t"},
    "dflash": {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"},
}


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_saved_checkpoint_loads_back_and_drafts_the_same(method: str, tmp_path: Path) -> None:
    """save_drafter writes the published layout; loading it from a directory gives the same drafter."""
    from safetensors import safe_open

    synthetic = spec_session(method, 3)
    assert synthetic.proposer is not None
    save_drafter(synthetic.proposer.drafter, synthetic.loaded.config.num_layers, tmp_path / method)
    with safe_open(str(tmp_path / method / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert EXPECTED_TENSORS[method] <= names and not any(n.startswith("model.") for n in names)
    raw = json.loads((tmp_path / method / "config.json").read_text())
    if method == "dflash":
        assert raw["dflash_config"]["mask_token_id"] == 511 and raw["block_size"] == 4

    request = load_request(num_kv_blocks=96)
    request.draft.CopyFrom(draft_model(method, 3))
    request.draft.source.path = method
    request.draft.ClearField("dflash_config")  # everything comes from the checkpoint now
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, tmp_path)
    assert draft.config == synthetic.proposer.config
    decision = common_pb2.BackendDecision(backend="CPU_ATTN")
    fixed = EngineSettings(64, 16, adaptive_speculation=False)  # the same drafts every step: the same stats
    session = build_session(source, request, decision, CPU, fixed, start=False, draft=draft, draft_decision=decision)
    prompt, sinks = {"a": [3, 1, 4, 1, 5, 9, 2, 6]}, (Collector(), Collector())
    for which, run in zip((synthetic, session), sinks, strict=True):
        add_all(which, prompt, greedy(10), run)
        which.engine.run_until_idle()
    assert sinks[0].outputs["a"][-1].finish == sinks[1].outputs["a"][-1].finish  # same drafts, same stats
    assert sinks[1].tokens("a") == greedy_reference(session.loaded.model, prompt["a"], 10)


def test_bad_drafter_checkpoint_names_what_is_wrong(tmp_path: Path) -> None:
    synthetic = spec_session("eagle3", 3)
    assert synthetic.proposer is not None
    save_drafter(synthetic.proposer.drafter, 2, tmp_path / "d")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    del state["midlayer.hidden_norm.weight"]
    state["fc.weight"] = state["fc.weight"][:, :8].contiguous()
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    request.draft.source.path = "d"
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, tmp_path)
    decision = common_pb2.BackendDecision(backend="CPU_ATTN")
    with pytest.raises(InvalidField) as err:  # the models layer's error; INVALID_ARGUMENT at the server's edge
        build_session(source, request, decision, CPU, EngineSettings(64, 16), start=False, draft=draft,
                      draft_decision=decision)  # fmt: skip
    assert isinstance(status_error(err.value), InvalidArgument)
    message = str(err.value)
    assert "midlayer.hidden_norm.weight" in message and "fc.weight" in message and "draft.source.path" in message


def draft_refusal(request: executor_pb2.LoadModelRequest) -> InvalidArgument:
    """The INVALID_ARGUMENT that resolving the request's drafter against its target raises."""
    source = resolve_target(request.target, None, "target")
    with pytest.raises(InvalidField) as err:
        resolve_draft(request.draft, source.config, None)
    status = status_error(err.value)
    assert isinstance(status, InvalidArgument)
    return status


def test_drafter_fields_are_checked_against_the_target() -> None:
    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 3))
    request.draft.dflash_config.ClearField("mask_token_id")
    request.draft.num_speculative_tokens = 9  # more than block_size - 1
    request.draft.source.synthetic.hidden_size = 32
    fields = {v.field for v in draft_refusal(request).field_violations}
    assert {
        "draft.dflash_config.mask_token_id",
        "draft.num_speculative_tokens",
        "draft.source.synthetic.hidden_size",
    } <= fields


def test_an_eagle3_drafter_of_another_vocabulary_is_refused_naming_it() -> None:
    """EAGLE-3's d2t maps its head onto the target's vocabulary, so the drafter's vocab_size must be the target's
    (the deep fuzzer found a synthetic drafter of vocab 2 with a head of 256 answered INTERNAL: a tensor size
    mismatch while building its d2t)."""
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    target_vocab = request.target.synthetic.vocab_size
    request.draft.source.synthetic.vocab_size = 2
    request.draft.source.synthetic.draft_vocab_size = 256
    (violation,) = draft_refusal(request).field_violations
    assert violation.field == "draft.source.synthetic.vocab_size"
    assert f"the target's {target_vocab}" in violation.description
    request.draft.source.synthetic.vocab_size = target_vocab  # the same drafter on the target's vocabulary loads
    source = resolve_target(request.target, None, "target")
    assert resolve_draft(request.draft, source.config, None).config.draft_vocab_size == 256


def test_non_causal_drafter_on_a_causal_only_backend_fails_clearly() -> None:
    """R9 at load time: a non-causal DFlash drafter on a backend without non-causal attention."""
    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 3))
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None)
    with pytest.raises(FailedPrecondition, match="non-causal"):
        check_drafter_backend(draft.config, "ROCM_AITER_UNIFIED_ATTN")
    causal = request.draft
    causal.dflash_config.causal = True
    check_drafter_backend(resolve_draft(causal, source.config, None).config, "ROCM_AITER_UNIFIED_ATTN")


def test_eagle3_default_feature_layers_fit_any_target() -> None:
    """EAGLE-3's defaults (the inputs of layers 2, L/2 and L - 3) clamp into a target of fewer than 5 layers: a
    1-layer target reads its one layer (the fuzzer found a 1-layer target refused with a field that does not exist,
    `draft.source.synthetic.target_layer_ids`)."""
    assert [default_eagle3_layers(n) for n in (1, 2, 3, 4, 5, 32)] == [
        (0,), (0, 1), (0, 1), (0, 1), (1,), (1, 15, 28)
    ]  # fmt: skip
    request = load_request()
    request.target.synthetic.num_layers = 1
    request.draft.CopyFrom(draft_model("eagle3", 3))
    source = resolve_target(request.target, None, "target")
    assert resolve_draft(request.draft, source.config, None).config.target_layer_ids == (0,)


def test_a_drafter_configs_layers_outside_the_target_name_its_source(tmp_path: Path) -> None:
    synthetic = spec_session("eagle3", 3)
    assert synthetic.proposer is not None
    save_drafter(synthetic.proposer.drafter, 2, tmp_path / "d")
    config_path = tmp_path / "d" / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 99]}
    config_path.write_text(json.dumps(config))
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    request.draft.source.path = "d"
    source = resolve_target(request.target, None, "target")
    with pytest.raises(InvalidField) as err:
        resolve_draft(request.draft, source.config, tmp_path)
    (violation,) = status_error(err.value).field_violations
    assert violation.field == "draft.source.path" and "target_layer_ids [99]" in violation.description
