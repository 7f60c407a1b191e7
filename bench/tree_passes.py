"""Tree drafting in the benchmarks: tree specs on the command line, and the target's verify pass over a tree
against the chain's at the same number of drafts.

    dynamic:TOP_K:BUDGET:DEPTH   e.g. dynamic:8:16:7 (EAGLE-2: top-8 per step, 16 drafts verified, 7 deep)
    static:B1-B2-...             e.g. static:4-2-2-1 (branching per depth)

The verify passes run eagerly (the chain is run the same way for a fair comparison; the whole device-resident
tree step, graphs included, is timed by specdec_bench.py's tree_step_times): one target forward over `batch`
requests of `context` cached tokens, each with a root and `budget` drafts; the chain with consecutive positions
and a causal mask, the tree with positions root + depth and a tree mask (a top-4 tree filled breadth first: the
mask's cost does not depend much on the shape).
"""

from __future__ import annotations

from typing import Any

import torch
from common import time_graph

from executor_service.models.attention_step import build_attention_step, cache_slot, to_device
from executor_service.server.session import ModelSession
from executor_service.spec_decode.host_verify import DraftTree
from kernels.tree_mask import tree_masks
from selection.draft_tree import tree_from_text
from specdec.v1 import common_pb2


def parse_tree_spec(text: str) -> tuple[str, common_pb2.DraftTree, int]:
    """(label, DraftTree, depth) of a spec (selection/draft_tree.py's forms); ValueError naming them otherwise."""
    tree, depth = tree_from_text(text)
    if tree.branching:
        return "tree_static_" + "-".join(map(str, tree.branching)), tree, len(tree.branching)
    return f"tree_top{tree.top_k}_budget{tree.verify_budget}_depth{depth}", tree, depth


def breadth_first_tree(size: int, branching: int = 4) -> list[int]:
    """Parents of `size` drafts: every node gets `branching` children, filled breadth first."""
    return [-1 if j < branching else j // branching - 1 for j in range(size)]


def measure_tree_verify(session: ModelSession, batch: int, context: int, budget: int, iters: int) -> dict[str, Any]:
    """Milliseconds of one target verify pass over `budget` drafts per request: chain and tree."""
    runner = session.engine.runner
    device, block_size = runner.device, runner.block_size
    allocator = session.kv_cache.allocator
    rows = budget + 1
    blocks = [allocator.allocate(-(-(context + rows) // block_size)) for _ in range(batch)]
    tree = DraftTree([0] * budget, breadth_first_tree(budget))
    depths = tree.depths()
    slots = [cache_slot(b, context + j, block_size) for b in blocks for j in range(rows)]
    chain_positions = [context + j for _ in blocks for j in range(rows)]
    tree_positions = [context + d for _ in blocks for d in [0, *depths]]
    masks = tree_masks([-1] + [p + 1 for p in tree.parents]) * batch
    ids = torch.zeros(batch * rows, dtype=torch.int64, device=device)
    report: dict[str, Any] = {"batch": batch, "context": context, "drafts": budget, "depth": max(depths)}
    try:
        for name, positions, tree_mask in (("chain", chain_positions, None), ("tree", tree_positions, masks)):

            @torch.inference_mode()
            def run(positions: list[int] = positions, tree_mask: list[int] | None = tree_mask) -> None:
                step = build_attention_step(
                    runner.backend, blocks, [rows] * batch, [context + rows] * batch, slots, True, device
                )
                if tree_mask is not None:
                    step.tree_mask = to_device(tree_mask, torch.int64, device)
                runner.forward(ids, to_device(positions, torch.int64, device), step, None)

            report[f"{name}_ms"] = round(time_graph(run, device, iters, warmup=2), 4)
    finally:
        for b in blocks:
            allocator.free(b)
    report["tree_over_chain"] = round(report["tree_ms"] / report["chain_ms"], 3)
    return report
