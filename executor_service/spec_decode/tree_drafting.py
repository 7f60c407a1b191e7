"""Tree drafting shared by every drafting method: a tree shape's candidates per depth (the drafter's top tokens)
and a dynamic tree's choice of the drafts it verifies. EAGLE's trees expand nodes pass by pass
(eagle_proposer.py), DFlash's read every depth from one block pass (dflash_proposer.py); both pick candidates and
select a dynamic tree's best nodes here.
"""

from __future__ import annotations

import torch

from executor_service.models.draft_models import Drafter, Eagle3Drafter
from executor_service.runner.step_constants import StepConstants
from executor_service.spec_decode.draft_penalties import DraftPenalties
from selection.draft_tree import TreeShape

# Ties broken toward shallower nodes, so that a parent always ranks above a child that scores the same.
DEPTH_TIE_BREAK = 1e-6


def static_parents(tree: TreeShape) -> list[int]:
    """The parents of a static tree's drafts as draft_tree lays them out: level by level, each node's children
    together, in its level's order."""
    parents, start, size = [-1] * tree.branching[0], 0, tree.branching[0]
    for branch in tree.branching[1:]:
        parents += [start + i // branch for i in range(size * branch)]
        start, size = start + size, size * branch
    return parents


def draft_vocab_ids(drafter: Drafter, constants: StepConstants) -> torch.Tensor | None:
    """The target's id of each id of the drafter's head (EAGLE-3's reduced vocabulary: a constant); None: the same
    ids."""
    return constants.get("draft to target", drafter.target_ids) if isinstance(drafter, Eagle3Drafter) else None


class TreeCandidates:
    """A tree shape's candidate picking and dynamic selection, for one drafter."""

    def __init__(self, tree: TreeShape, drafter: Drafter, constants: StepConstants, device: torch.device) -> None:
        self.tree, self.drafter, self.constants, self.device = tree, drafter, constants, device
        # Each depth's top candidates in one Triton launch on GPUs (kernels/triton_topk.py), torch's softmax and
        # top-k elsewhere; tests turn it on on the CPU under TRITON_INTERPRET=1.
        self.fused = torch.device(device).type == "cuda"

    def top(
        self, head: torch.Tensor, width: int, scores: bool = True, penalties: DraftPenalties | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The drafter's `width` most likely next tokens [N, width] (target ids) and their log-probabilities
        (float32, cast inside the softmax; None without `scores`: a static tree ranks by the logits alone), from
        the logits penalised under each request's history where `penalties` (head: each request's rows in turn).
        Equal values: the lower index first with the fused kernel; torch's order (unspecified on CUDA) without."""
        to_target = draft_vocab_ids(self.drafter, self.constants)
        logits = self.drafter.draft_logits(head)
        if penalties is not None:
            logits = penalties.apply(logits)
        if self.fused:  # one launch: softmax, top-k and the id map (width <= MAX_TREE_TOP_K = its MAX_K)
            from kernels.triton_topk import topk_log_softmax

            log_probs, ids = topk_log_softmax(logits, width, to_target, normalize=scores)
            return (log_probs if scores else None), ids
        if scores:
            log_probs, ids = logits.log_softmax(-1, dtype=torch.float32).topk(width, dim=-1)
        else:
            log_probs, ids = None, logits.topk(width, dim=-1).indices
        return log_probs, ids if to_target is None else to_target[ids]

    def dynamic_tree(
        self, pool_tokens: list[torch.Tensor], pool_scores: list[torch.Tensor], frontiers: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic tree's verified drafts from its pool (every level's candidates [B, size] and their cumulative
        scores) and the nodes each level expanded (`frontiers`: level indices, depth 1's first)."""
        constants, count = self.constants, pool_tokens[0].shape[0]
        # Each drafted child's parent: the pool index of the node it was drafted from (level start + index).
        # The expanded nodes' level indices behind a zero column: each pool node's parent is one of them plus its
        # level's start (a root's: the zero column less one), picked by one constant index.
        zero = constants.get("zero column", lambda: torch.zeros(1, 1, dtype=torch.int64, device=self.device))
        columns = torch.cat([zero.expand(count, -1), *frontiers], dim=1)
        pick = constants.get(("parent columns", self.tree), lambda: self._parent_columns()[0])
        starts = constants.get(("parent starts", self.tree), lambda: self._parent_columns()[1])
        parents = columns.index_select(1, pick) + starts
        return self.select(torch.cat(pool_tokens, 1), torch.cat(pool_scores, 1), parents)

    def _parent_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[pool] each node's column of [zero | the expanded nodes' level indices, depth by depth] and what to add:
        -1 for depth 1 (the root), else the start of the parent's level in the pool (level 1 starts at 0, level
        d + 1 at top_k + (d - 1) * top_k^2). Child j of a pass is child j % top_k of its expanded node j // top_k."""
        top_k, depth = self.tree.top_k, self.tree.depth
        pick, starts = [0] * top_k, [-1] * top_k
        for level in range(1, depth):  # the pass over level `level`'s expanded nodes drafts level + 1
            start = 0 if level == 1 else top_k + (level - 2) * top_k * top_k
            pick += [1 + (level - 1) * top_k + j // top_k for j in range(top_k * top_k)]
            starts += [start] * (top_k * top_k)
        return torch.tensor(pick, device=self.device), torch.tensor(starts, device=self.device)

    def select(
        self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic tree's verified drafts: the verify_budget best (ties to the shallower), in pool order
        (topological: parents are drafted first), parents renumbered into it; tokens and parents [B, W]."""
        pool = tokens.shape[1]
        tie_break = self.constants.get(("tie break", pool), self._tie_break)
        chosen = (scores - tie_break).topk(min(self.tree.verify_budget, pool), dim=-1).indices.sort(dim=-1).values
        # A chosen node's parent is chosen too: its new index is the count of chosen pool indices up to it, less
        # one (the root's, -1: none). One search over the sorted choice, no [B, pool] table to fill.
        new_parents = torch.searchsorted(chosen, parents.gather(1, chosen), right=True) - 1
        return tokens.gather(1, chosen), new_parents

    def _tie_break(self) -> torch.Tensor:
        depth = torch.cat([torch.full((size,), d, device=self.device) for d, size in enumerate(self.tree.level_sizes)])
        return DEPTH_TIE_BREAK * depth

    def static_parents_tensor(self) -> torch.Tensor:
        return torch.tensor([static_parents(self.tree)], dtype=torch.int64, device=self.device)
