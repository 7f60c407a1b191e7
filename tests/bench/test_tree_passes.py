"""bench/tree_passes.py at tiny size on the CPU: the tree specs the benches take, and the tree vs chain verify pass
(both timed, the blocks it borrows given back)."""

from __future__ import annotations

import pytest
from executor_builders import tiny_session
from tree_passes import breadth_first_tree, measure_tree_verify, parse_tree_spec

from specdec.v1 import common_pb2


def test_tree_specs() -> None:
    assert parse_tree_spec("dynamic:8:16:7") == (
        "tree_top8_budget16_depth7",
        common_pb2.DraftTree(top_k=8, verify_budget=16),
        7,
    )
    assert parse_tree_spec("static:4-2-1") == ("tree_static_4-2-1", common_pb2.DraftTree(branching=[4, 2, 1]), 3)
    for bad in ("dynamic:8:16", "static:4-x", "chain:7"):
        with pytest.raises(ValueError, match="dynamic:TOP_K"):
            parse_tree_spec(bad)
    assert breadth_first_tree(7, 2) == [-1, -1, 0, 0, 1, 1, 2]


def test_tree_and_chain_verify_passes() -> None:
    session = tiny_session()
    report = measure_tree_verify(session, batch=2, context=40, budget=9, iters=2)
    assert report["chain_ms"] > 0 and report["tree_ms"] > 0 and report["depth"] == 2
    assert session.kv_cache.allocator.num_used == 0
