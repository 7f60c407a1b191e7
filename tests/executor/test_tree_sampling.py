"""Sampling along a tree keeps the target's distribution: the seeded requests and exact marginals of
test_spec_sampling (6-token vocabulary, every continuation enumerated), verified as trees (EAGLE-3 and DFlash, static
and dynamic), with a total-variation bound that a wrong multi-candidate sampler (shown alongside) fails."""

from __future__ import annotations

import pytest
import torch
from spec_sampling_runs import BATCH, BOUND, SETTINGS, VOCAB, exact_marginals, run_requests, total_variations
from tree_cases import tree_session

import executor_service.tree_verification as tree_verification
import executor_service.verifier as verifier
from executor_service.session import ModelSession
from executor_service.tree_verification import DraftTree, TreeVerdict
from specdec.v1 import common_pb2

SHAPES = {
    "static_2_2": (common_pb2.DraftTree(branching=[2, 2]), 0),
    "dynamic_2_budget_4_depth_3": (common_pb2.DraftTree(top_k=2, verify_budget=4), 3),
}


def session(shape: str, method: str = "eagle3") -> ModelSession:
    tree, k = SHAPES[shape]
    return tree_session(
        method, tree, k, vocab_size=VOCAB, draft_seed=4, max_num_seqs=BATCH,
        max_num_batched_tokens=8 * BATCH, num_kv_blocks=2 * BATCH,
    )  # fmt: skip


def no_residual(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> TreeVerdict:
    """Right walk, wrong correction: every child is tested against p itself (rejected siblings keep their mass)
    and a node whose children all fail draws from p, so drafted tokens come out too often."""
    children, path, row = tree.children(), [], 0
    while True:
        accepted = None
        for j in children[row]:
            if float(torch.rand((), generator=generator)) < float(probs[row, tree.tokens[j]]):
                accepted = j
                break
        if accepted is None:
            final = int(torch.multinomial(probs[row], 1, generator=generator))
            return TreeVerdict(path, [tree.tokens[j] for j in path] + [final])
        path.append(accepted)
        row = accepted + 1


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_sampling_keeps_the_target_distribution(shape: str, method: str) -> None:
    spec = session(shape, method)
    settings = SETTINGS["temperature"]
    empirical, drafted, accepted = run_requests(spec, settings)
    assert 0 < accepted < drafted
    distances = total_variations(empirical, exact_marginals(spec.loaded.model, settings))
    assert max(distances) < BOUND, distances


def without_residual(logprobs, layout, last, seed, step_key, constants):  # type: ignore[no-untyped-def]
    """In place of the verifier's final draw: from p, the rejected children not removed."""
    kept = verifier.DraftLayout(**{**layout.__dict__, "present": torch.zeros_like(layout.tokens, dtype=torch.bool)})
    return TRUE_FINAL_DRAWS(logprobs, kept, last, seed, step_key, constants)


TRUE_FINAL_DRAWS = verifier._final_draws


@pytest.mark.parametrize("path", ["host", "device"])
def test_the_bound_catches_a_wrong_tree_sampler(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = session("static_2_2")
    settings = SETTINGS["temperature"]
    if path == "host":
        monkeypatch.setattr(spec.engine, "spec_step", None)
        monkeypatch.setattr(tree_verification, "sample_tree", no_residual)
    else:
        monkeypatch.setattr(verifier, "_final_draws", without_residual)
    empirical, _, _ = run_requests(spec, settings)
    distances = total_variations(empirical, exact_marginals(spec.loaded.model, settings))
    assert distances[0] < BOUND  # the prefill verifies no drafts
    assert max(distances[1:]) > BOUND, distances
