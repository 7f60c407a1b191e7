"""Tree drafting with the fused top-k kernel (kernels/triton_topk.py, under the interpreter on the CPU): greedy
output equals target-only, and the trees drafted (host path and device step) are the ones torch's softmax and
top-k draft (random fp32 drafters: no equal candidates, so the tie order does not enter)."""

from __future__ import annotations

import os

import pytest
from tree_cases import TREES, check_equals_target_only, prompts, tree_session

from kernels import triton_topk

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU sessions run the kernel under TRITON_INTERPRET=1 (on a GPU, test_gpu_tree_step.py runs it)",
)


@pytest.mark.parametrize(
    ("method", "shape"),
    [
        ("eagle3", "static_3_2"),
        ("eagle3", "dynamic_3_budget_8_depth_4"),
        ("eagle", "dynamic_2_budget_5_depth_3"),
        ("dflash", "static_3_2"),
        ("dflash", "dynamic_3_budget_8_depth_4"),
    ],
)
def test_fused_top_k_drafts_the_torch_trees(method: str, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    kernel = triton_topk.topk_log_softmax

    def counted(*args, **kwargs):
        calls.append(kwargs.get("normalize", True))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_topk, "topk_log_softmax", counted)
    drafted: list[list[tuple[str, int, list[int], list[int]]]] = []
    for fused in (False, True):
        tree, k = TREES[shape]
        session = tree_session(method, tree, k)
        proposer, trees = session.proposer, []
        proposer.candidates.fused = fused
        set_tree = proposer.set_tree

        def record(request, tokens: list[int], parents: list[int], probs=None, trees=trees, set_tree=set_tree) -> None:
            trees.append((request.request_id, len(request.output_ids), list(tokens), list(parents)))
            set_tree(request, tokens, parents, probs)

        proposer.set_tree = record
        session.engine.spec_step.counts.clear()
        check_equals_target_only(session, 10, prompts(2, seed=31))
        assert session.engine.spec_step.counts["eager"] + session.engine.spec_step.counts["eager following"] > 0
        drafted.append(trees)
        assert bool(calls) == fused
    assert set(calls) == {"dynamic" in shape}  # log-probabilities for dynamic trees only
    assert len(drafted[0]) > 3 and drafted[0] == drafted[1]
