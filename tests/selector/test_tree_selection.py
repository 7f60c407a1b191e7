"""R11: tree drafting needs tree attention for the target (it verifies the tree) and an EAGLE drafter (it drafts
it; DFlash drafts it in one block pass); auto-selection passes over backends without it with the reason, a forced
one is refused; the DraftTree shape is checked with bounds, every bad field named."""

from __future__ import annotations

import pytest
from builders import cpu, cuda, dflash, eagle, request, rocm

from kernels.capabilities import TREE_ATTENTION_NOT_SUPPORTED
from selection.draft_tree import MAX_TREE_DRAFTS, TreeShape, parse_draft_tree
from selection.selector import select_backends
from specdec.v1 import common_pb2
from specdec_runtime.errors import InvalidArgument

H100_FA4 = cuda(9, 0, flash_attn="4.0.0b36")
DYNAMIC = common_pb2.DraftTree(top_k=4, verify_budget=16)
STATIC = common_pb2.DraftTree(branching=[4, 2, 1])


@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_auto_selection_picks_a_backend_with_tree_attention(tree: common_pb2.DraftTree) -> None:
    k = 5 if tree is DYNAMIC else 3
    response = select_backends(request(H100_FA4, speculative=eagle(k=k, tree=tree)))
    for decision in (response.target, response.drafter):
        assert decision.backend == "TRITON_ATTN" and decision.use_tree_attention
        verdicts = {c.backend: list(c.reasons) for c in decision.candidates}
        assert verdicts["FLASH_ATTN"] == [TREE_ATTENTION_NOT_SUPPORTED]
    chain = select_backends(request(H100_FA4, speculative=eagle(k=7)))  # without a tree: FLASH_ATTN as before
    assert chain.target.backend == chain.drafter.backend == "FLASH_ATTN"
    assert not chain.target.use_tree_attention
    assert select_backends(request(rocm(), speculative=eagle(tree=DYNAMIC))).target.backend == "TRITON_ATTN"
    assert select_backends(request(cpu(), speculative=eagle(tree=DYNAMIC))).drafter.backend == "CPU_ATTN"


def test_a_forced_backend_without_tree_attention_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=TREE_ATTENTION_NOT_SUPPORTED) as err:
        select_backends(request(H100_FA4, backend="FLASH_ATTN", speculative=eagle(tree=STATIC)))
    assert [v.field for v in err.value.field_violations] == ["attention.backend"]
    with pytest.raises(InvalidArgument, match=TREE_ATTENTION_NOT_SUPPORTED) as err:
        select_backends(request(H100_FA4, speculative=eagle(backend="FLASH_ATTN", tree=STATIC)))
    assert [v.field for v in err.value.field_violations] == ["speculative.attention_backend"]
    forced = select_backends(request(H100_FA4, backend="FLEX_ATTENTION", speculative=eagle(tree=STATIC)))
    assert forced.target.backend == "FLEX_ATTENTION" and forced.target.explicit


def test_shapes() -> None:
    static, _ = parse_draft_tree(STATIC, False, 0, "t", "k")
    assert static == TreeShape(depth=3, branching=(4, 2, 1))
    assert (static.num_drafts, static.num_inputs, static.level_sizes) == (20, 12, (4, 8, 8))
    dynamic, _ = parse_draft_tree(DYNAMIC, False, 6, "t", "k")
    assert dynamic is not None and (dynamic.num_drafts, dynamic.num_inputs, dynamic.depth) == (16, 20, 6)
    assert parse_draft_tree(common_pb2.DraftTree(), False, 3, "t", "k") == (None, [])  # empty: a chain


@pytest.mark.parametrize(
    ("tree", "k", "fields"),
    [
        (common_pb2.DraftTree(branching=[4, 0, 2]), 0, ["t.branching[1]"]),
        (common_pb2.DraftTree(branching=[8, 8]), 0, ["t.branching"]),  # 72 drafts > 63
        (common_pb2.DraftTree(branching=[2, 2]), 3, ["k"]),
        (common_pb2.DraftTree(branching=[2], top_k=2), 0, ["t"]),
        (common_pb2.DraftTree(top_k=0, verify_budget=8), 4, ["t.top_k"]),
        (common_pb2.DraftTree(top_k=4, verify_budget=MAX_TREE_DRAFTS + 1), 4, ["t.verify_budget"]),
        (common_pb2.DraftTree(top_k=4, verify_budget=-1), 4, ["t.verify_budget"]),
        (common_pb2.DraftTree(top_k=8, verify_budget=16), 10, ["t.top_k"]),  # 72 expanded nodes
        (common_pb2.DraftTree(top_k=2, verify_budget=30), 2, ["t.verify_budget"]),  # only 6 candidates
        (common_pb2.DraftTree(top_k=2, verify_budget=8), 40, ["k"]),
        (common_pb2.DraftTree(top_k=2, verify_budget=2), 3, ["t.verify_budget"]),  # depth 3 never verified
    ],
)
def test_bad_trees_name_their_fields(tree: common_pb2.DraftTree, k: int, fields: list[str]) -> None:
    shape, violations = parse_draft_tree(tree, False, k, "t", "k")
    assert shape is None and [v.field for v in violations] == fields


@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_a_dflash_tree_needs_tree_attention_for_the_target_only(tree: common_pb2.DraftTree) -> None:
    response = select_backends(request(H100_FA4, speculative=dflash(k=3 if tree is STATIC else 7, tree=tree)))
    assert response.target.backend == "TRITON_ATTN" and response.target.use_tree_attention
    assert response.drafter.backend == "FLASH_ATTN" and not response.drafter.use_tree_attention
    assert response.drafter.use_non_causal  # the block pass as in a chain


def test_a_dflash_tree_expands_no_nodes() -> None:
    """Top-8 over 15 depths would be 112 expanded EAGLE nodes (refused); DFlash drafts them in one block pass."""
    tree = common_pb2.DraftTree(top_k=8, verify_budget=32)
    assert [v.field for v in parse_draft_tree(tree, False, 15, "t", "k")[1]] == ["t.top_k"]
    assert parse_draft_tree(tree, True, 15, "t", "k") == (TreeShape(depth=15, top_k=8, verify_budget=32), [])
