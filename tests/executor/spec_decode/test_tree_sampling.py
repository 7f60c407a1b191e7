"""Sampling along a tree keeps the target's distribution: the seeded requests and exact marginals of
test_spec_sampling (6-token vocabulary, every continuation enumerated), verified as trees (EAGLE-3 and DFlash, static
and dynamic), with a total-variation bound that a wrong multi-candidate sampler (shown alongside, on the host path
and the device step: the one verifier) fails."""

from __future__ import annotations

import pytest
from spec_sampling_runs import BATCH, BOUND, SETTINGS, VOCAB, exact_marginals, run_requests, total_variations
from tree_cases import tree_session
from verify_reference import accepts_all

import executor_service.spec_decode.verifier as verifier
from executor_service.server.session import ModelSession
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


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_sampling_keeps_the_target_distribution(shape: str, method: str) -> None:
    spec = session(shape, method)
    settings = SETTINGS["temperature"]
    empirical, drafted, accepted = run_requests(spec, settings)
    assert 0 < accepted < drafted
    distances = total_variations(empirical, exact_marginals(spec.loaded.model, settings))
    assert max(distances) < BOUND, distances


@pytest.mark.parametrize("path", ["host", "device"])
def test_the_bound_catches_a_wrong_tree_sampler(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = session("static_2_2")
    settings = SETTINGS["temperature"]
    if path == "host":
        monkeypatch.setattr(spec.engine, "spec_step", None)
    monkeypatch.setattr(verifier, "_greedy_hits", accepts_all)
    empirical, _, _ = run_requests(spec, settings)
    distances = total_variations(empirical, exact_marginals(spec.loaded.model, settings))
    assert distances[0] < BOUND  # the prefill verifies no drafts
    assert max(distances[1:]) > BOUND, distances
