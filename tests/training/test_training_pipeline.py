"""`specdec train-drafter` end to end on the CPU with a toy target trained on trivial data (its greedy
continuation is a 64-token cycle): responses generated through the engine, each method's loss falls, the
published checkpoint loads with the executor's loader and drafts losslessly, and it is accepted far more
often than the same drafter untrained. Runs are deterministic from the seed and resume exactly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from greedy_reference import greedy_reference
from toy_target import VOCAB, save_toy_target, toy_target

from executor_service.engine.request import RequestOutput
from executor_service.models.draft_config import METHOD_ENUMS
from executor_service.models.draft_weights import save_drafter
from executor_service.models.loader import LoadedModel
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.drafting import DraftSource, resolve_draft
from executor_service.server.session import EngineSettings, TargetSource, build_session
from specdec.v1 import common_pb2, executor_pb2
from specdec_training.cli import build_parser, run
from specdec_training.init import trainable_drafter

CPU = torch.device("cpu")
DATA = ["--random-prompts", "48", "--max-new-tokens", "24", "--temperatures", "0", "--no-progress", "--device", "cpu"]
SMALL = ["--batch-size", "8", "--intermediate-size", "128", "--lr", "3e-3", "--epochs", "10"]
METHOD_ARGS = {
    "eagle": ["--ttt-steps", "3"],
    "eagle3": ["--ttt-steps", "3", "--draft-vocab-size", str(VOCAB)],
    "dflash": [
        "--block-size",
        "4",
        "--num-anchors",
        "8",
        "--num-layers",
        "1",
        "--num-feature-layers",
        "2",
        "--lr",
        "1e-2",
        "--epochs",
        "20",
    ],
}
K = 3  # drafts per verify step in the engine runs (DFlash: block 4)


def train(target: Path, out: Path, method: str, *extra: str) -> dict:
    argv = ["--method", method, "--target", str(target), "--out", str(out), *DATA, *SMALL, *METHOD_ARGS[method], *extra]
    return run(build_parser().parse_args(argv), "test")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_toy_target(tmp_path_factory.mktemp("toy_target"))


@pytest.fixture(scope="module")
def trained(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    runs = {}
    for method in METHOD_ARGS:
        out = tmp_path_factory.mktemp(method)
        runs[method] = (out, train(target_dir, out, method))
    return runs


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_loss_falls_and_acceptance_rises_on_held_out_sequences(method: str, trained: dict) -> None:
    _, log = trained[method]
    history = log["history"]
    assert log["finished"] and log["steps"] == (120 if method == "dflash" else 60) == history[-1]["step"]
    assert history[-1]["loss"] < 0.5 * history[0]["loss"], [h["loss"] for h in history]
    before, after = log["validation_before"]["accept_length"], log["validation_after"]["accept_length"]
    assert before < 1.3 and after > before + 0.7, (before, after)
    assert log["data"]["sequences"] == 48 and log["data"]["response_tokens"] == 48 * 24
    assert log["seconds"]["training"] > 0 and log["device"] == "cpu" and log["command"] == "test"


def speculative_run(draft: DraftSource, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy speculative generation with the toy target: outputs and mean accepted drafts per verify step."""
    model = toy_target()
    request = executor_pb2.LoadModelRequest(dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=64, block_size=16)
    decision = common_pb2.BackendDecision(backend="CPU_ATTN")
    loaded = LoadedModel(model.config, model, None, "toy")
    session = build_session(TargetSource(model.config, None), request, decision, CPU, EngineSettings(256, 16),
                            start=False, draft=draft, draft_decision=decision, preloaded=loaded)  # fmt: skip
    outputs: dict[str, list[RequestOutput]] = {str(i): [] for i in range(len(prompts))}
    for index, prompt in enumerate(prompts):
        sink = outputs[str(index)].append
        session.engine.add(session.new_request(str(index), prompt, SamplingSettings(), 20, sink))
    session.engine.run_until_idle()
    finishes = [o[-1].finish for o in outputs.values()]
    accepted = sum(f.accepted_tokens for f in finishes) / sum(f.verify_steps for f in finishes)  # type: ignore[union-attr]
    return [[t for o in outputs[str(i)] for t in o.token_ids] for i in range(len(prompts))], accepted


@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_published_drafter_loads_drafts_losslessly_and_beats_the_untrained_one(
    method: str, trained: dict, tmp_path: Path
) -> None:
    out, _ = trained[method]
    model = toy_target()
    request = executor_pb2.DraftModel(method=METHOD_ENUMS[method], num_speculative_tokens=K, source={"path": "drafter"})
    draft = resolve_draft(request, model.config, out)  # as LoadModel reads DraftModel.source.path
    untrained, _ = trainable_drafter(draft.config, model, [], seed=0, device=CPU)
    save_drafter(untrained, model.config.num_layers, tmp_path / "drafter")
    untrained_draft = resolve_draft(request, model.config, tmp_path)
    rng = random.Random(99)  # prompts the training never saw
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(6)]
    tokens, accepted = speculative_run(draft, prompts)
    _, accepted_untrained = speculative_run(untrained_draft, prompts)
    assert tokens == [greedy_reference(model, prompt, 20) for prompt in prompts]  # lossless
    assert accepted > 1.0 and accepted_untrained < 0.3, (accepted, accepted_untrained)  # of K = 3 drafts


def checkpoint_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=False)["drafter"]


def assert_same_weights(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(
    method: str, trained: dict, target_dir: Path, tmp_path: Path
) -> None:
    first = train(target_dir, tmp_path, method, "--stop-after-steps", "23", "--checkpoint-every", "10")
    assert first == {"finished": False, "steps": 23}
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 23
    resumed = train(target_dir, tmp_path, method, "--resume")
    assert resumed["finished"] and resumed["steps"] == trained[method][1]["steps"]
    assert_same_weights(checkpoint_state(tmp_path), checkpoint_state(trained[method][0]))
    assert resumed["history"] == trained[method][1]["history"]


def test_the_seed_decides_the_weights(trained: dict, target_dir: Path, tmp_path: Path) -> None:
    again = train(target_dir, tmp_path / "again", "dflash")
    assert again["validation_after"] == trained["dflash"][1]["validation_after"]
    assert_same_weights(checkpoint_state(tmp_path / "again"), checkpoint_state(trained["dflash"][0]))
    train(target_dir, tmp_path / "other", "dflash", "--seed", "1")
    assert not torch.equal(
        checkpoint_state(tmp_path / "other")["fc.weight"], checkpoint_state(tmp_path / "again")["fc.weight"]
    )
