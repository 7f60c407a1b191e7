"""DFlash trees (dflash_proposer.py): each depth's candidates are the block position's most likely tokens.
The tree's first path is the chain's drafts from the same drafter and context; the siblings are the runners-up
in order; a dynamic tree keeps the best paths by summed log-probability."""

from __future__ import annotations

from engine_driving import Collector, add_all
from executor_builders import greedy
from spec_builders import spec_session
from tree_cases import VOCAB, prompts, tree_session

from executor_service.server.session import ModelSession
from executor_service.spec_decode.dflash_proposer import DFlashProposer
from executor_service.spec_decode.host_verify import DraftTree
from specdec.v1 import common_pb2

BLOCK = 8  # tree_session's DFlash block (draft_model with k = 7)


def first_proposals(session: ModelSession, batch: dict[str, list[int]], tree: bool) -> dict[str, tuple]:
    """Each request's first drafts after its prefill (tokens, and for a tree its parents)."""
    seen: dict[str, tuple] = {}

    def record_tree(request, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        seen.setdefault(request.request_id, (list(tokens), list(parents)))
        return tokens, parents

    def record_chain(request, drafts: list[int]) -> list[int]:
        seen.setdefault(request.request_id, (list(drafts),))
        return drafts

    if tree:
        session.proposer.replay_tree = record_tree
    else:
        session.proposer.replay = record_chain
    add_all(session, batch, greedy(4), Collector())
    session.engine.run_until_idle()
    return seen


def test_the_first_path_is_the_chains_drafts_and_siblings_differ() -> None:
    session = tree_session("dflash", common_pb2.DraftTree(branching=[3, 2, 1]))
    assert isinstance(session.proposer, DFlashProposer) and session.proposer.tree is not None
    batch = prompts(3, seed=11)
    trees = first_proposals(session, batch, tree=True)
    chain = first_proposals(spec_session("dflash", BLOCK - 1, vocab_size=VOCAB), batch, tree=False)
    for rid in batch:
        tokens, parents = trees[rid]
        assert parents == [-1, -1, -1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8]
        first_path = [tokens[0], tokens[3], tokens[9]]  # node 0, its first child, that one's first child
        assert first_path == chain[rid][0][:3], rid
        assert len(set(tokens[:3])) == 3 and tokens[3] != tokens[4]  # position 1's top 3, position 2's top 2
        assert tokens[3:9] == tokens[3:5] * 3  # every branch of a depth carries the same candidates


def test_a_dynamic_tree_keeps_the_best_paths() -> None:
    """Budget 1: the single best candidate (position 1's argmax); a larger one keeps every ancestor too."""
    batch = prompts(2, seed=13)
    chain = first_proposals(spec_session("dflash", BLOCK - 1, vocab_size=VOCAB), batch, tree=False)
    one = first_proposals(tree_session("dflash", common_pb2.DraftTree(top_k=2, verify_budget=1), 1), batch, True)
    wide = first_proposals(tree_session("dflash", common_pb2.DraftTree(top_k=3, verify_budget=10), 5), batch, True)
    for rid in batch:
        assert one[rid] == ([chain[rid][0][0]], [-1])
        tokens, parents = wide[rid]
        assert len(tokens) == 10 and all(p < i for i, p in enumerate(parents))  # topological, ancestors kept
        depths = DraftTree(tokens, parents).depths()
        assert depths[0] == 1 and tokens[0] == chain[rid][0][0]
        deepest = max(depths)
        path = [tokens[i] for i, d in enumerate(depths) if d <= deepest and _on_first_path(parents, i)]
        assert path == chain[rid][0][: len(path)]


def _on_first_path(parents: list[int], node: int) -> bool:
    """Whether `node` descends from node 0 by first children only (each ancestor the lowest-index child)."""
    while node != -1:
        parent = parents[node]
        siblings = [i for i, p in enumerate(parents) if p == parent]
        if node != siblings[0]:
            return False
        node = parent
    return True
