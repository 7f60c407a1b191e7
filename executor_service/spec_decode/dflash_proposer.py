"""DFlash drafting: one block pass drafts every position at once from the target's context features.

- Context pass: the target's rows' features become the drafter's context K/V (`store_context`), no tokens.
- Chain: one pass over the block [newest token, MASK x (B - 1)], non-causal unless configured causal (R9), its
  metadata built on the device from the newest verified position; position i's argmax is draft i.
- Tree: the same block pass gives every depth's candidates at once, each drawn from the context alone (not from
  the drafts before it). A chain keeps only each position's argmax, so one wrong guess at depth d ends the step
  even when the target's token was the drafter's second choice; a tree keeps the runners-up as siblings, as
  Medusa does with its independent heads. Static `branching` [b1, ..., bD]: every node at depth d - 1 gets
  position d's top b_d tokens as children (every branch of a depth carries the same candidates); dynamic
  (`top_k`, `verify_budget`): the top_k paths by cumulative log-probability are expanded with position d's
  top_k tokens, and the verify_budget best nodes of all depths are verified (tree_drafting.py). The tree costs
  the chain's one drafter pass; only the target's verify pass grows.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from executor_service.models.attention_step import AttentionStep
from executor_service.spec_decode.draft_penalties import DraftPenalties
from executor_service.spec_decode.draft_sampling import DraftSampler, StepDraws
from executor_service.spec_decode.proposer import (
    DraftPass,
    OwnMetadataForward,
    PassForward,
    Pick,
    ProposeBatch,
    Proposer,
    _reads_block_table,
)
from executor_service.spec_decode.verifier import Verdict


class DFlashProposer(Proposer):
    """DFlash drafters (draft_models.DFlashDrafter), chains and trees."""

    CONTEXT_PASS = "dflash_context"

    @property
    def scratch_width(self) -> int:
        """The block pass writes the whole block, from the position after the newest verified token."""
        return self.config.block_size

    def _draft_chain(
        self, batch: ProposeBatch, sampler: DraftSampler | None, penalties: DraftPenalties | None = None
    ) -> torch.Tensor:
        features, positions, _, step = self.context_pass(batch)
        uniform = all(e.propose and e.num_rows == self.num_draft_tokens + 1 for e in batch.entries)
        self._run("dflash_context", uniform, step, positions, features=features)
        proposing = [e.request for e in batch.entries if e.propose]
        if not proposing:
            return torch.empty(0)
        starts = [r.num_tokens - 1 for r in proposing]  # the newest token opens the block
        newest = [r.token_ids(s, s + 1)[0] for r, s in zip(proposing, starts, strict=True)]
        size = self.config.block_size
        inputs = {
            "input_ids": self.tensor(newest, torch.int64),
            "ahead_slots": self.slots_ahead(proposing, starts, size),
        }
        block_table, positions = self.block_table(proposing), self.tensor(starts, torch.int64)
        if sampler is not None or penalties is not None:  # noise keyed from the host, counts per pick: eager
            self.pass_counts["dflash_block sampled" if sampler is not None else "dflash_block penalised"] += 1
            return self._dflash_block(block_table, positions, inputs, self._picker(sampler, penalties))[0]
        (tokens,) = self._run_device_metadata("dflash_block", block_table, positions, inputs)
        return tokens

    def _propose_verified_chain(
        self,
        step: AttentionStep,
        positions: torch.Tensor,
        features: torch.Tensor,
        verdict: Verdict,
        slots_ahead: torch.Tensor,
        draws: StepDraws | None = None,
        penalties: DraftPenalties | None = None,
    ) -> torch.Tensor:
        """The chain [B, num_steps] after a verify step on the device: the verify rows' context K/V, then the block
        opened by the bonus token after the newest verified row; `draws`: its drafts drawn from q (sampled
        requests) instead of the argmax; `penalties`: picked under them, position by position."""
        target_ids, accepted = verdict.emitted, verdict.accepted
        count, rows = target_ids.shape
        context_step = replace(step, backend=self.backend, _flex=None)  # the verify rows, the drafter's kernels
        first = positions.view(count, rows)[:, 0]
        self._dflash_context(context_step, positions, {"features": features})
        newest = target_ids.gather(1, accepted[:, None])[:, 0]  # the bonus token opens the block
        starts = first + accepted + 1
        ahead = slots_ahead.gather(1, (accepted + 1)[:, None] + self._offsets(self.config.block_size))
        pick = self._picker(draws, penalties)
        return self._dflash_block(step.block_table, starts, {"input_ids": newest, "ahead_slots": ahead}, pick)[0]

    def block_step(
        self, block_table: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor
    ) -> tuple[AttentionStep, torch.Tensor]:
        """DFlash's block pass: B queries per request from `starts` on, and their positions."""
        count, size = starts.shape[0], self.config.block_size
        offsets = torch.arange(size, device=starts.device)
        step = AttentionStep(
            backend=self.backend,
            block_table=block_table,
            query_start_loc=torch.arange(count + 1, dtype=torch.int32, device=starts.device) * size,
            seq_lens=(starts + size).clamp(max=self.max_model_len).to(torch.int32),
            slot_mapping=slots.reshape(-1),
            max_query_len=size,
            max_seq_len=self.max_model_len,
            causal=self.config.causal,
        )
        return step, (starts[:, None] + offsets).clamp(max=self.max_model_len - 1).reshape(-1)

    def _passes(self) -> dict[str, DraftPass]:
        """Each pass a graph can replay, by name: the context K/V (of a verify step's rows, or one row per
        request), and the block after it."""
        hidden = self.config.model.hidden_size
        features = len(self.config.target_layer_ids) * hidden or hidden
        dtype, ids = self.kv_cache.storage.dtype, ((), torch.int64)
        size = self.config.block_size
        return {
            "dflash_context": DraftPass(
                self._dflash_context, self.num_draft_tokens + 1, {"features": ((features,), dtype)}
            ),
            "dflash_context row": DraftPass(self._dflash_context, 1, {"features": ((features,), dtype)}),
            "dflash_block": DraftPass(
                _reads_block_table(self._dflash_block), 1, {"input_ids": ids},
                {"ahead_slots": ((size,), torch.int64, -1)},
            ),
        }  # fmt: skip

    def _metadata_forward(self, name: str) -> OwnMetadataForward:
        assert name == "dflash_block", name
        return self._dflash_block

    def _dflash_context(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        self.drafter.store_context(x["features"], positions, step.slot_mapping, self.kv_cache.layers)
        return ()

    def _dflash_block(
        self, block_table: torch.Tensor, starts: torch.Tensor, x: dict[str, torch.Tensor], pick: Pick | None = None
    ) -> tuple:
        """Drafts [B, num_steps] from the block opened by `input_ids` at `starts`; `ahead_slots` [B, block]. `pick`: how
        the drafts of all positions are chosen at once (the argmax)."""
        hidden = self.dflash_block_hidden(block_table, starts, x)[:, 1 : self.num_steps + 1]  # slot i: token i
        return ((pick or self.drafter.draft_tokens)(hidden),)

    def dflash_block_hidden(
        self, block_table: torch.Tensor, starts: torch.Tensor, x: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The block pass's normed hidden states [B, block, H]: slot i reads as the draft of the block's token i."""
        size, count = self.config.block_size, starts.shape[0]
        block_step, positions = self.block_step(block_table, starts, x["ahead_slots"])
        block_ids = torch.full((count, size), self.config.mask_token_id, dtype=torch.int64, device=starts.device)
        block_ids[:, 0] = x["input_ids"]
        hidden = self.drafter(block_ids.reshape(-1), positions, self.kv_cache.layers, block_step)
        return hidden.view(count, size, hidden.shape[-1])

    def context_pass_rows(
        self, step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor,
        forward: PassForward | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Store the verified rows' context K/V. Returns, per row, the token after it (in the place of both of
        EAGLE's per-row outputs): at the newest verified row, the token that opens the next block."""
        (forward or self._dflash_context)(step, positions, {"features": features})
        opening = next_ids[:, None]
        return opening, opening

    def draft_tree(
        self, block_table: torch.Tensor, last: torch.Tensor, scratch: torch.Tensor, head: torch.Tensor,
        hidden: torch.Tensor, penalties: DraftPenalties | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The trees [B, drafts] (tokens, parents; -1: the root) on the device, no host sync: one block pass
        opened by `head` [B, 1] (the token after the newest verified row, at `last` + 1; `hidden` unused) that
        writes the slots `scratch` [B, block], then each depth's candidates from block position `depth`."""
        tree, count = self.tree, head.shape[0]
        assert tree is not None and self.candidates is not None
        inputs = {"input_ids": head[:, 0], "ahead_slots": scratch}
        block = self.dflash_block_hidden(block_table, last + 1, inputs)[:, 1 : tree.depth + 1]  # [B, D, H]
        width = tree.top_k if tree.dynamic else max(tree.branching)
        log_probs, ids = self.candidates.top(block.reshape(-1, block.shape[-1]), width, tree.dynamic, penalties)
        ids = ids.view(count, tree.depth, width)
        if not tree.dynamic:
            pick = self.constants.get(("dflash static picks", tree), self._static_picks)
            parents = self.constants.get("static parents", self.candidates.static_parents_tensor)
            return ids.reshape(count, -1).index_select(1, pick), parents.expand(count, -1)
        assert log_probs is not None
        log_probs = log_probs.view(count, tree.depth, width)
        if self.candidates.fused:  # the tree below in one launch (kernels/triton_dflash_tree.py)
            from kernels.triton_dflash_tree import dflash_dynamic_tree

            tie_break = self.constants.get(("tie break", sum(tree.level_sizes)), self.candidates._tie_break)
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
        return self.candidates.dynamic_tree(pool_tokens, pool_scores, frontiers)

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
