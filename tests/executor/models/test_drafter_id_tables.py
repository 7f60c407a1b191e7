"""Every token-id table a drafter checkpoint brings is range-checked at load (issue 36, items 11 and 12): EAGLE-3's
`d2t` and `t2d`, DFlash's mask token, and the width of EAGLE-3's own head. Such a checkpoint, written by the
project's exporter, used to load (or fail INTERNAL with an IndexError), and the first request that drafted a bad id
then failed every drafting request of its step with INTERNAL "index out of range in self". Now LoadModel answers
INVALID_ARGUMENT naming the tensor and the served model keeps serving; with the tables checked, EAGLE-3's draft ids
(argmax over its head's draft_vocab_size rows, then + d2t) and the other drafters' (the target's own head) cannot
leave the target's vocabulary."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from executor_builders import load_request, tiny_model
from load_refusals import RPC_TIMEOUT_S, assert_still_serving, generate, refusal, write_drafter
from rpc_details import violations
from safetensors.torch import load_file, save_file
from spec_builders import draft_model

from executor_service.models.draft_models import TargetHeads
from executor_service.models.draft_weights import save_drafter, synthetic_drafter
from executor_service.server.drafting import resolve_draft
from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2, executor_pb2_grpc

VOCAB = 512  # the tiny target's
FIELD = "draft.source.path"


def eagle3_with(tmp_path: Path, name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """An EAGLE-3 checkpoint for the tiny target from the exporter, its tensors then changed by `change`."""
    write_drafter(tmp_path / name)
    state = load_file(str(tmp_path / name / "model.safetensors"))
    change(state)
    save_file(state, str(tmp_path / name / "model.safetensors"))
    return name


def exported_with_bad_d2t(tmp_path: Path) -> str:
    """The exporter's own output for a drafter whose d2t sends its last 8 draft ids past the target's vocabulary."""
    target = tiny_model()
    draft = resolve_draft(draft_model("eagle3", 3), target.config, None)
    heads = TargetHeads(target.model.embed_tokens, target.model.lm_head)
    drafter = synthetic_drafter(draft.config, heads, 7, torch.float32, torch.device("cpu"))
    size = drafter.d2t.shape[0]
    drafter.d2t[-8:] = VOCAB + 5 - torch.arange(size - 8, size)  # target id VOCAB + 5 for each
    save_drafter(drafter, target.config.num_layers, tmp_path / "exported")
    return "exported"


def eagle3_request(path: str) -> executor_pb2.LoadModelRequest:
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    request.draft.source.path = path
    return request


def dflash_with_mask(tmp_path: Path, mask: int) -> executor_pb2.LoadModelRequest:
    write_drafter(tmp_path / "dflash", "dflash")
    raw = json.loads((tmp_path / "dflash" / "config.json").read_text())
    raw["dflash_config"]["mask_token_id"] = mask
    (tmp_path / "dflash" / "config.json").write_text(json.dumps(raw))
    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 3))
    request.draft.source.path = "dflash"
    request.draft.ClearField("dflash_config")
    return request


def negative_d2t(state: dict[str, torch.Tensor]) -> None:
    state["d2t"][0] = -1  # draft id 0 -> target id -1


def int_t2d(state: dict[str, torch.Tensor]) -> None:
    t2d = torch.full((VOCAB,), -1, dtype=torch.int64)
    t2d[3] = state["d2t"].shape[0]  # one past the draft vocabulary
    state["t2d"] = t2d


def short_t2d(state: dict[str, torch.Tensor]) -> None:
    state["t2d"] = torch.zeros(VOCAB // 2, dtype=torch.bool)


def wide_head(state: dict[str, torch.Tensor]) -> None:
    """A head with more rows than the config's draft vocabulary (and d2t entries)."""
    state["lm_head.weight"] = torch.cat([state["lm_head.weight"], state["lm_head.weight"][:4]])


async def test_id_tables_out_of_range_are_invalid_argument_naming_the_tensor(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, tmp_path: Path
) -> None:
    info = (await stub.LoadModel(load_request(), timeout=RPC_TIMEOUT_S)).info
    cases = {
        "exported d2t": (eagle3_request(exported_with_bad_d2t(tmp_path)), FIELD, "tensor d2t maps 8 of 256 draft ids"),
        "negative d2t": (eagle3_request(eagle3_with(tmp_path, "neg", negative_d2t)), FIELD, "0 -> -1"),
        "t2d ids": (eagle3_request(eagle3_with(tmp_path, "t2d", int_t2d)), FIELD, "tensor t2d maps 1 target ids"),
        "t2d shape": (eagle3_request(eagle3_with(tmp_path, "short", short_t2d)), FIELD, "tensor t2d has shape [256]"),
        "wide head": (eagle3_request(eagle3_with(tmp_path, "wide", wide_head)), FIELD, "lm_head.weight: [260, 64]"),
        "mask token": (dflash_with_mask(tmp_path, VOCAB), "draft.dflash_config.mask_token_id", f"[0, {VOCAB})"),
    }
    for case, (request, field, said) in cases.items():
        err = await refusal(stub, request)
        assert err.code().name == "INVALID_ARGUMENT", (case, err.code(), err.details())
        assert field in violations(err) and said in err.details(), (case, err.details())
        await assert_still_serving(executor, stub, info, case)
    assert len(await generate(stub, "after", 4)) == 4


@pytest.mark.parametrize("width", [VOCAB + 1, 2 * VOCAB])
async def test_an_eagle3_head_wider_than_the_target_vocabulary_is_refused(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, tmp_path: Path, width: int
) -> None:
    """A config whose draft vocabulary exceeds the target's: its head could draft ids no d2t maps back."""
    write_drafter(tmp_path / "wide")
    raw = json.loads((tmp_path / "wide" / "config.json").read_text())
    raw["draft_vocab_size"] = width
    (tmp_path / "wide" / "config.json").write_text(json.dumps(raw))
    err = await refusal(stub, eagle3_request("wide"))
    assert err.code().name == "INVALID_ARGUMENT" and f"{FIELD}.draft_vocab_size" in violations(err), err.details()


async def test_valid_tables_load_and_draft_inside_the_vocabulary(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, tmp_path: Path
) -> None:
    """SafeAILab's boolean t2d mask, or none: the checkpoint loads and serves drafting requests."""

    def both_maps(state: dict[str, torch.Tensor]) -> None:
        targets = torch.arange(state["d2t"].shape[0]) + state["d2t"]
        state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, targets, True)

    for name, change in {"mask": both_maps, "plain": lambda state: None}.items():
        loaded = await stub.LoadModel(eagle3_request(eagle3_with(tmp_path, name, change)), timeout=RPC_TIMEOUT_S)
        assert loaded.info.num_speculative_tokens == 3
        assert len(await generate(stub, name, 8)) == 8
