"""Training on CUDA: the dense bf16 features match the engine's (TRITON_ATTN, bf16) within bf16 rounding,
and every method trains under bf16 autocast, is published, loads and drafts losslessly on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from toy_target import VOCAB, save_toy_target

from executor_service.engine.kv_cache import KVCache
from executor_service.engine.request import RequestOutput
from executor_service.models.attention_step import build_attention_step
from executor_service.models.draft_config import METHOD_ENUMS, feature_layers
from executor_service.models.loader import load_directory
from executor_service.runner.model_runner import ModelRunner
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, TargetSource, build_session
from specdec.v1 import common_pb2, executor_pb2
from specdec_training.cli import build_parser, run
from specdec_training.features import Sequence, collate, target_view
from specdec_training.recipes import RECIPES, draft_config, with_overrides

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
BACKEND = "TRITON_ATTN"
METHOD_ARGS = {
    "eagle": ["--ttt-steps", "3"],
    "eagle3": ["--ttt-steps", "3", "--draft-vocab-size", str(VOCAB)],
    "dflash": ["--block-size", "4", "--num-anchors", "8", "--num-layers", "1", "--lr", "1e-2", "--epochs", "20"],
}


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_bf16_dense_features_match_the_engines(method: str, tmp_path: Path) -> None:
    loaded = load_directory(save_toy_target(tmp_path / "target"), torch.bfloat16, CUDA, "target")
    config = draft_config(with_overrides(RECIPES[method], num_feature_layers=2), loaded.config, mask_token_id=0)
    ids = [5, 17, 30, 2, 9, 44, 12, 7, 8, 25, 1, 3, 60, 61]
    cache = KVCache(loaded.config, num_blocks=4, block_size=16, dtype=torch.bfloat16, device=CUDA)
    runner = ModelRunner(loaded.model, cache, BACKEND, CUDA, feature_layers(config))
    step = build_attention_step(BACKEND, [[0]], [len(ids)], [len(ids)], list(range(len(ids))), True, CUDA)
    with torch.inference_mode():
        logits, features = runner.forward(
            torch.tensor(ids, device=CUDA), torch.arange(len(ids), device=CUDA), step, None
        )
    view = target_view(loaded.model, config, collate([Sequence(ids[:3], ids[3:])], 64, CUDA))
    torch.testing.assert_close(view.features[0].float(), features.float(), rtol=0.05, atol=0.05)
    assert (view.labels[0] == logits.argmax(-1)).float().mean() >= 0.9


def generate(target: Path, draft: executor_pb2.DraftModel | None, out: Path | None, prompts: list[list[int]]):
    request = executor_pb2.LoadModelRequest(dtype=common_pb2.DTYPE_BFLOAT16, num_kv_blocks=64, block_size=16)
    loaded = load_directory(target, torch.bfloat16, CUDA, "target")
    decision = common_pb2.BackendDecision(backend=BACKEND)
    source = resolve_draft(draft, loaded.config, out) if draft is not None else None
    session = build_session(TargetSource(loaded.config, None), request, decision, CUDA, EngineSettings(256, 16),
                            start=False, draft=source, draft_decision=decision, preloaded=loaded)  # fmt: skip
    outputs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}
    for index, prompt in enumerate(prompts):
        session.engine.add(session.new_request(str(index), prompt, SamplingSettings(), 20, outputs[str(index)].append))
    session.engine.run_until_idle()
    tokens = [[t for o in outputs[str(i)] for t in o.token_ids] for i in range(len(prompts))]
    finishes = [o[-1].finish for o in outputs.values()]
    steps = sum(f.verify_steps for f in finishes)  # type: ignore[union-attr]
    return tokens, sum(f.accepted_tokens for f in finishes) / max(steps, 1)  # type: ignore[union-attr]


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_each_method_trains_under_bf16_autocast_and_drafts_losslessly(method: str, tmp_path: Path) -> None:
    target = save_toy_target(tmp_path / "target")
    argv = ["--method", method, "--target", str(target), "--out", str(tmp_path / "run"), "--device", "cuda",
            "--random-prompts", "48", "--max-new-tokens", "24", "--temperatures", "0", "--no-progress",
            "--batch-size", "8", "--intermediate-size", "128", "--lr", "3e-3", "--epochs", "10",
            *METHOD_ARGS[method]]  # fmt: skip
    log = run(build_parser().parse_args(argv), "gpu test")
    assert log["history"][-1]["loss"] < 0.5 * log["history"][0]["loss"]
    assert log["validation_after"]["accept_length"] > log["validation_before"]["accept_length"] + 0.7
    draft = executor_pb2.DraftModel(method=METHOD_ENUMS[method], num_speculative_tokens=3, source={"path": "drafter"})
    prompts = [[(7 * i + j) % VOCAB for j in range(2 + i)] for i in range(6)]
    expected, _ = generate(target, None, None, prompts)
    tokens, accepted = generate(target, draft, tmp_path / "run", prompts)
    assert tokens == expected and accepted > 1.0, accepted
