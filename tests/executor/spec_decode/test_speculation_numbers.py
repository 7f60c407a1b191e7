"""The numbers of speculation (docs/executor.md): LoadModel's num_speculative_tokens is read once
(draft_config.read_speculation) as the drafter's num_steps; its num_draft_tokens, the drafts verified per step,
follow from the shape (a chain's length, a tree's node count), for EAGLE and DFlash alike."""

from __future__ import annotations

import pytest

from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import DraftConfig, read_speculation
from specdec.v1 import common_pb2, executor_pb2

LAYERS = ModelConfig("llama", 1, 1, 1, 1, 1, 1, 2)  # the drafter's layers play no part here
BLOCK = 16  # DFlash's block: its default chain drafts block - 1


def tree(branching: tuple[int, ...] = (), top_k: int = 0, budget: int = 0) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(branching=list(branching), top_k=top_k, verify_budget=budget)


@pytest.mark.parametrize(
    ("method", "wire", "shape", "num_steps", "width", "num_draft_tokens"),
    [
        ("eagle3", 0, tree(), 3, None, 3),  # a chain: EAGLE's default length
        ("eagle", 5, tree(), 5, None, 5),
        ("dflash", 0, tree(), BLOCK - 1, None, BLOCK - 1),  # DFlash's default: the block's drafts
        ("eagle3", 0, tree((4, 2, 1)), 3, (4, 2, 1), 4 + 8 + 8),  # static: depth len(branching), every node
        ("eagle3", 3, tree((4, 2, 1)), 3, (4, 2, 1), 20),
        ("dflash", 0, tree((2, 2, 1, 1)), 4, (2, 2, 1, 1), 2 + 4 + 4 + 4),
        ("eagle3", 5, tree(top_k=4, budget=10), 5, 4, 10),  # dynamic: depth from the wire, the budget verified
        ("dflash", 7, tree(top_k=3, budget=16), 7, 3, 16),
    ],
)
def test_three_numbers(
    method: str, wire: int, shape: common_pb2.DraftTree, num_steps: int, width: object, num_draft_tokens: int
) -> None:
    request = executor_pb2.DraftModel(num_speculative_tokens=wire, tree=shape)
    steps, read_tree, violations = read_speculation(request, method, BLOCK if method == "dflash" else 0)
    assert not violations
    config = DraftConfig(method, LAYERS, steps, block_size=BLOCK if method == "dflash" else 0, tree=read_tree)
    assert config.num_steps == num_steps
    if read_tree is None:
        assert width is None  # a chain: one draft per step
    else:
        assert read_tree.depth == num_steps
        assert (read_tree.branching or read_tree.top_k) == width
    assert config.num_draft_tokens == num_draft_tokens


def test_out_of_range_names_the_wire_field() -> None:
    request = executor_pb2.DraftModel(num_speculative_tokens=BLOCK)  # past DFlash's block - 1
    _, _, violations = read_speculation(request, "dflash", BLOCK)
    assert [v.field for v in violations] == ["draft.num_speculative_tokens"]


def test_a_chain_lookahead_follows_a_requests_own_drafts() -> None:
    """A request verifying fewer drafts than the drafter (per-request speculation) writes fewer positions ahead."""
    chain = DraftConfig("eagle3", LAYERS, 5)
    assert (chain.positions_ahead, chain.lookahead(2), chain.lookahead(0)) == (6, 3, 0)
