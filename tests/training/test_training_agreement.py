"""Training sees what inference sees: the dense target features and labels equal the engine's (paged
cache, ModelRunner), and the dense training passes of each drafter reproduce, token for token, the drafts
the engine's proposer made during speculative decoding (same positions, masks, feature layers)."""

from __future__ import annotations

import pytest
import torch
from engine_driving import Collector, add_all
from executor_builders import tiny_model
from spec_builders import spec_session

from executor_service.engine.kv_cache import KVCache
from executor_service.engine.request import Request
from executor_service.models.attention_step import build_attention_step
from executor_service.models.draft_config import feature_layers
from executor_service.models.draft_models import DFlashDrafter
from executor_service.runner.model_runner import ModelRunner
from executor_service.sample.sampling import SamplingSettings
from specdec_training.features import Sequence, collate, target_view
from specdec_training.unroll import dflash_blocks, eagle_unroll

CPU = torch.device("cpu")
METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


def engine_features(model, layers: tuple[int, ...], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelRunner.forward over a paged cache for one prefill of `ids`: (logits, features)."""
    cache = KVCache(model.config, num_blocks=8, block_size=16, dtype=torch.float32, device=CPU)
    runner = ModelRunner(model, cache, "CPU_ATTN", CPU, layers)
    blocks = cache.allocator.allocate(-(-len(ids) // 16))
    slots = [blocks[p // 16] * 16 + p % 16 for p in range(len(ids))]
    step = build_attention_step("CPU_ATTN", [blocks], [len(ids)], [len(ids)], slots, True, CPU)
    with torch.inference_mode():
        logits, features = runner.forward(torch.tensor(ids), torch.arange(len(ids)), step, None)
    return logits, features


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_dense_features_and_labels_equal_the_engines(method: str, architecture: str) -> None:
    session = spec_session(method, 3)
    assert session.proposer is not None
    config = session.proposer.config
    model = tiny_model(architecture, seed=3).model
    rows = [[5, 17, 300, 2, 9, 44, 123, 7, 8, 250, 1, 3], [60, 61, 62, 63, 64]]  # padded as a batch of two
    batch = collate([Sequence(r[:2], r[2:]) for r in rows], max_len=64, device=CPU)
    view = target_view(model, config, batch)
    for index, row in enumerate(rows):
        logits, features = engine_features(model, feature_layers(config), row)
        torch.testing.assert_close(view.features[index, : len(row)], features, rtol=1e-5, atol=1e-5)
        assert view.labels[index, : len(row)].tolist() == logits.argmax(-1).tolist()
    width = sum(model.config.hidden_size for _ in feature_layers(config)) or model.config.hidden_size
    assert view.features.shape[-1] == width
    assert view.valid[1].tolist() == [False, True, True, True, False] + [False] * 7  # tokens 2..4 are the response


class ProposalRecorder:
    """Proposer.replay hook: records (tokens so far, drafts) of every proposal, drafts unchanged."""

    def __init__(self) -> None:
        self.proposals: list[tuple[list[int], list[int]]] = []

    def __call__(self, request: Request, drafts: list[int]) -> list[int]:
        self.proposals.append((request.token_ids(0, request.num_tokens), list(drafts)))
        return drafts


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 4])
def test_training_passes_reproduce_the_engines_drafts(method: str, k: int) -> None:
    session = spec_session(method, k)
    proposer = session.proposer
    assert proposer is not None
    recorder = ProposalRecorder()
    proposer.replay = recorder
    batch = {"a": [3, 1, 4, 1, 5, 9, 2, 6], "b": [100, 200, 300], "c": list(range(40, 70))}
    add_all(session, batch, SamplingSettings(), Collector())
    session.engine.run_until_idle()
    assert len(recorder.proposals) > 10
    drafter, model = proposer.drafter, session.loaded.model
    for tokens, drafts in recorder.proposals:
        newest = len(tokens) - 1  # verified rows 0 .. newest - 1; tokens[newest] opens the proposal
        sequence = tokens + drafts[:-1]  # the chain reads its own drafts: the continuation it assumes
        view = target_view(model, proposer.config, collate([Sequence(sequence, [])], 256, CPU))
        with torch.no_grad():
            if isinstance(drafter, DFlashDrafter):
                hidden = dflash_blocks(drafter, view.ids, view.features, torch.tensor([[newest]]))
                ours = drafter.draft_tokens(hidden[0, 0, 1 : k + 1]).tolist()
            else:
                steps = eagle_unroll(drafter, view.ids, view.features, k)
                ours = [int(drafter.draft_tokens(step.head[0, newest - 1])) for step in steps]
        assert ours == drafts, (tokens, drafts)
