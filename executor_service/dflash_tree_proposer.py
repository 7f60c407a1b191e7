"""Tree drafting with DFlash: one block pass drafts every depth's candidates, and a tree keeps more than the argmax.

A DFlash block pass reads the context once and gives a distribution for each of the block's positions, each
drawn from the context alone (not from the drafts before it). A chain keeps only each position's argmax, so
one wrong guess at depth d ends the step even when the target's token was the drafter's second choice. A tree
keeps the runners-up as siblings, as Medusa does with its independent heads:

- static `branching` [b1, ..., bD]: every node at depth d - 1 gets position d's top b_d tokens as children, so
  every branch of a depth carries the same candidates;
- dynamic (`top_k`, `verify_budget`): the top_k paths by cumulative log-probability are expanded with position
  d's top_k tokens, and the verify_budget best nodes of all depths are verified (TreeProposer._select).

The tree costs no more drafter passes than the chain (one block pass); the target verifies more rows. The
context pass stores the verified rows' K/V as the chain's does; the block opens at the token after the newest
verified row. Verification and the device step are every tree's and chain's (engine.py, spec_step.py).
"""

from __future__ import annotations

import torch

from executor_service.attention_step import AttentionStep
from executor_service.tree_proposer import TreeProposer


class DFlashTreeProposer(TreeProposer):
    drafts_dflash = True
    drafter_kinds = "a DFlash drafter"

    @property
    def scratch_width(self) -> int:
        """The block pass writes the whole block, from the position after the newest verified token."""
        return self.config.block_size

    def context_pass_rows(
        self, step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the verified rows' context K/V. Returns, per row, the token after it (as both of
        TreeProposer's per-row outputs): at the newest verified row, the token that opens the next block."""
        self.drafter.store_context(features, positions, step.slot_mapping, self.kv_cache.layers)
        opening = next_ids[:, None]
        return opening, opening

    def draft_tree(
        self, block_table: torch.Tensor, last: torch.Tensor, scratch: torch.Tensor, head: torch.Tensor,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The trees [B, drafts] (tokens, parents; -1: the root) on the device, no host sync: one block pass
        opened by `head` [B, 1] (the token after the newest verified row, at `last` + 1; `hidden` unused) that
        writes the slots `scratch` [B, block], then each depth's candidates from block position `depth`."""
        tree, count = self.tree, head.shape[0]
        inputs = {"input_ids": head[:, 0], "ahead_slots": scratch}
        block = self.dflash_block_hidden(block_table, last + 1, inputs)[:, 1 : tree.depth + 1]  # [B, D, H]
        width = tree.top_k if tree.dynamic else max(tree.branching)
        log_probs, ids = self.top_candidates(block.reshape(-1, block.shape[-1]), width, scores=tree.dynamic)
        ids = ids.view(count, tree.depth, width)
        if not tree.dynamic:
            pick = self.constants.get(("dflash static picks", tree), self._static_picks)
            parents = self.constants.get("static parents", lambda: self._static_parents_tensor())
            return ids.reshape(count, -1).index_select(1, pick), parents.expand(count, -1)
        assert log_probs is not None
        log_probs = log_probs.view(count, tree.depth, width)
        if self.fused_top_k:  # the tree below in one launch (kernels/triton_dflash_tree.py)
            from kernels.triton_dflash_tree import dflash_dynamic_tree

            tie_break = self.constants.get(("tie break", sum(tree.level_sizes)), self._tie_break)
            return dflash_dynamic_tree(log_probs, ids, tie_break, tree.verify_budget)
        top_k = tree.top_k
        pool_tokens, pool_scores = [ids[:, 0]], [log_probs[:, 0]]
        frontiers = [self.constants.arange(top_k).expand(count, -1)]
        frontier_scores = log_probs[:, 0]
        for depth in range(1, tree.depth):  # child j of a level: position depth's candidate j % top_k
            pool_tokens.append(ids[:, depth, None, :].expand(-1, top_k, -1).reshape(count, -1))
            scores = (frontier_scores[:, :, None] + log_probs[:, depth, None, :]).reshape(count, -1)
            pool_scores.append(scores)
            if depth < tree.depth - 1:
                frontier_scores, candidates = scores.topk(top_k, dim=-1)
                frontiers.append(candidates)
        return self._dynamic_tree(pool_tokens, pool_scores, frontiers)

    def _static_picks(self) -> torch.Tensor:
        """[drafts] each static node's index into the candidates [D x width]: node j of depth d is position
        d's candidate j % b_d (a level lists each parent's children together, in the parents' order)."""
        branching, width = self.tree.branching, max(self.tree.branching)
        picks = [
            depth * width + j % branch
            for depth, (branch, size) in enumerate(zip(branching, self.tree.level_sizes, strict=True))
            for j in range(size)
        ]
        return torch.tensor(picks, dtype=torch.int64, device=self.device)
