"""EAGLE and EAGLE-3 drafting: the drafter predicts the next feature from the target's features and its own
previous token, one position per pass.

- Context pass: the drafter over the target's rows, each paired with the token after it (EAGLE's first step).
- Chain: from the newest verified row, k - 1 more chain steps, one token per request. Each step's attention
  metadata (positions, seq_lens, slot_mapping) is rebuilt before it runs (R10), on the device, from the newest
  verified position and the slots ahead of it, so the whole chain replays as one CUDA graph.
- Tree: depth 1 is the drafter's top candidates after the newest token (b1 of them, or top_k); each further
  depth is one drafter pass over the nodes being expanded, all requests and nodes at once. A node at depth d is
  the input at position `last + d` (as a chain's d-th draft), with the hidden state of the pass that drafted it;
  its key goes to the next free slot past the newest verified token (one per expanded node, the scheduler's
  lookahead), and a tree mask lets it see the context, its ancestors and itself. Static trees expand every node
  (b_d children each); dynamic trees (EAGLE-2) expand the top_k nodes of the depth by cumulative confidence (the
  sum of the drafter's log-probabilities along the path), and verify the verify_budget best candidates of all
  depths (a child never scores above its parent, so the set keeps every ancestor), in topological order.
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
from kernels.tree_mask import TREE_WINDOW, to_int64


class EagleProposer(Proposer):
    """EAGLE-1 and EAGLE-3 drafters (draft_models.py), chains and trees."""

    CONTEXT_PASS = "eagle_context"

    @property
    def scratch_width(self) -> int:
        """Keys a tree proposal's drafter passes write past the newest verified token: one per expanded node."""
        assert self.tree is not None
        return max(self.tree.num_inputs, 1)

    def _draft_chain(
        self, batch: ProposeBatch, sampler: DraftSampler | None, penalties: DraftPenalties | None = None
    ) -> torch.Tensor:
        features, positions, next_ids, step = self.context_pass(batch)
        uniform = all(e.propose and e.num_rows == self.num_draft_tokens + 1 for e in batch.entries)
        feedback, head = self._run("eagle_context", uniform, step, positions, input_ids=next_ids, features=features)
        sample_rows, proposing, offset = [], [], 0
        for entry in batch.entries:
            if entry.propose:
                sample_rows.append(offset + entry.num_valid - 1)  # the newest verified row
                proposing.append(entry.request)
            offset += entry.num_rows
        if not proposing:
            return torch.empty(0)
        picked = self.tensor(sample_rows, torch.int64)
        pick = self._picker(sampler, penalties)
        tokens, hidden = pick(head[picked]), feedback[picked]
        last = [r.num_computed_tokens - 1 for r in proposing]  # position of each request's newest verified row
        own = [self.num_drafts(r) for r in proposing]  # the chain runs num_steps - 1 steps; each keeps its own
        ahead = self.slots_ahead(proposing, last, self.num_steps, own)
        chain_inputs = {"input_ids": tokens, "hidden": hidden, "ahead_slots": ahead}
        block_table, positions = self.block_table(proposing), self.tensor(last, torch.int64)
        if sampler is not None or penalties is not None:  # noise keyed from the host, counts per pick: eager
            self.pass_counts["eagle_chain sampled" if sampler is not None else "eagle_chain penalised"] += 1
            (rest,) = self._eagle_chain(block_table, positions, chain_inputs, pick)
        else:
            (rest,) = self._run_device_metadata("eagle_chain", block_table, positions, chain_inputs)
        return torch.cat([tokens[:, None], rest], dim=1)

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
        """The chain [B, num_steps] after a verify step on the device: the context pass over the verify rows with the
        emitted tokens, then the chain steps from the newest verified row (row `accepted`); `draws`: each step's
        drafts drawn from q (sampled requests) instead of the argmax; `penalties`: picked under them."""
        target_ids, accepted = verdict.emitted, verdict.accepted
        count, rows = target_ids.shape
        context_step = replace(step, backend=self.backend, _flex=None)  # the verify rows, the drafter's kernels
        first = positions.view(count, rows)[:, 0]
        context = {"input_ids": target_ids.reshape(-1), "features": features}
        feedback, head = self._eagle_context(context_step, positions, context)
        picked = torch.arange(count, device=accepted.device) * rows + accepted  # the newest verified row
        pick = self._picker(draws, penalties)
        tokens, hidden = pick(head[picked]), feedback[picked]
        ahead = slots_ahead.gather(1, accepted[:, None] + self._offsets(self.num_steps))
        chain = {"input_ids": tokens, "hidden": hidden, "ahead_slots": ahead}
        (rest,) = self._eagle_chain(step.block_table, first + accepted, chain, pick)
        return torch.cat([tokens[:, None], rest], dim=1)

    def chain_step(
        self, block_table: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
        seq_lens: torch.Tensor, slots: torch.Tensor,
    ) -> AttentionStep:  # fmt: skip
        """One chain step: one query per request at `positions`, written to `slots`."""
        return AttentionStep(
            backend=self.backend,
            block_table=block_table,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=slots,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _passes(self) -> dict[str, DraftPass]:
        """Each pass a graph can replay, by name: the context pass (over a verify step's rows, or one row per
        request), and the chain after it."""
        hidden = self.config.model.hidden_size
        features = len(self.config.target_layer_ids) * hidden or hidden
        dtype, ids = self.kv_cache.storage.dtype, ((), torch.int64)
        context_inputs = {"input_ids": ids, "features": ((features,), dtype)}
        return {
            "eagle_context": DraftPass(self._eagle_context, self.num_draft_tokens + 1, context_inputs),
            "eagle_context row": DraftPass(self._eagle_context, 1, context_inputs),
            "eagle_chain": DraftPass(
                _reads_block_table(self._eagle_chain),
                1,
                {"input_ids": ids, "hidden": ((hidden,), dtype)},
                {"ahead_slots": ((self.num_steps,), torch.int64, -1)},
            ),
        }

    def _metadata_forward(self, name: str) -> OwnMetadataForward:
        assert name == "eagle_chain", name
        return self._eagle_chain

    def _eagle_context(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        hidden = self.drafter.combine(x["features"])
        return self.drafter(x["input_ids"], positions, hidden, self.kv_cache.layers, step)

    def _eagle_chain(
        self, block_table: torch.Tensor, positions: torch.Tensor, x: dict[str, torch.Tensor], pick: Pick | None = None
    ) -> tuple:
        """Drafts 2..n [B, n - 1] (n: num_steps) from draft 1 (`input_ids`, `hidden`) at the newest verified
        `positions`; `ahead_slots` [B, n]: slots of positions + 0..n-1. `pick`: how a step's drafts are chosen
        (the argmax)."""
        pick = pick or self.drafter.draft_tokens
        tokens, hidden, drafted = x["input_ids"], x["hidden"], []
        # Every chain step's metadata at once, one row per step (a few kernels instead of a few per step).
        steps = torch.arange(1, self.num_steps, device=positions.device)[:, None]
        # A request whose slots end early (fewer drafts of its own, the context's end) repeats its last
        # writable position, written nowhere (slot -1): no step reads past its blocks. -1 only at the tail.
        writable = (x["ahead_slots"] >= 0).sum(dim=1)
        steps = torch.minimum(steps, (writable - 1).clamp(min=0)[None, :])
        chain_positions = (positions[None, :] + steps).clamp(max=self.max_model_len - 1)  # [num_steps - 1, B]
        chain_seq_lens = (chain_positions + 1).to(torch.int32)
        chain_slots = x["ahead_slots"][:, 1:].t().contiguous()
        query_start_loc = torch.arange(positions.shape[0] + 1, dtype=torch.int32, device=positions.device)
        cos, sin = self._rotary_grid(chain_positions, hidden.dtype)  # [num_steps - 1, B, 1, D/2]
        for j in range(self.num_steps - 1):
            step = self.chain_step(block_table, query_start_loc, chain_positions[j], chain_seq_lens[j], chain_slots[j])
            hidden, head = self.drafter(
                tokens, chain_positions[j], hidden, self.kv_cache.layers, step, rotary=(cos[j], sin[j])
            )
            tokens = pick(head)
            drafted.append(tokens)
        if not drafted:
            return (torch.empty(tokens.shape[0], 0, dtype=torch.int64, device=tokens.device),)
        return (torch.stack(drafted, dim=1),)

    def _rotary_grid(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, 1, D/2] of every drafter pass's positions in one lookup, not two gathers (and
        casts) per pass: a chain's steps, a tree's depths."""
        cos, sin = self.drafter.rope.lookup(positions.reshape(-1), dtype)
        return cos.view(*positions.shape, *cos.shape[1:]), sin.view(*positions.shape, *sin.shape[1:])

    def context_pass_rows(
        self, step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor,
        forward: PassForward | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """EAGLE's context pass over the rows (Proposer.context_pass_rows)."""
        inputs = {"input_ids": next_ids, "features": features}
        feedback, head = (forward or self._eagle_context)(step, positions, inputs)
        return feedback, head

    def draft_tree(
        self, block_table: torch.Tensor, last: torch.Tensor, scratch: torch.Tensor, head: torch.Tensor,
        hidden: torch.Tensor, penalties: DraftPenalties | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """EAGLE's trees (Proposer.draft_tree), one drafter pass per depth over the nodes it expands. A static
        tree's layout (parents, which node expands which, the masks) is constant: only its tokens and hidden
        states move; a dynamic tree also carries its scores, parents and frontier."""
        tree, count, constants = self.tree, head.shape[0], self.constants
        assert tree is not None and self.candidates is not None
        dynamic = tree.dynamic
        first_width = tree.top_k if dynamic else tree.branching[0]
        log_probs, tokens = self.candidates.top(head, first_width, dynamic, penalties)  # [B, w]
        pool_tokens, pool_scores = [tokens], [log_probs]
        # Dynamic: the nodes each pass expands, as indices into their level (depth 1's: the pool's first level).
        frontiers = [constants.arange(first_width).expand(count, -1)]
        frontier_tokens, frontier_scores = tokens, log_probs
        frontier_hidden = hidden[:, None].expand(-1, first_width, -1)
        ancestors = None  # [B, frontier] bits over scratch indices (dynamic)
        # Each pass's sequence lengths, [depth, B]: last + 1 + the scratch keys written once the pass has run.
        written = constants.get(("written", tree), lambda: (self._written() + 1).to(torch.int32))
        seq_lens = last.to(torch.int32)[None, :] + written[:, None]
        # Position last + d of every depth's queries, clamped to the context (the last steps of a request).
        ahead = (last[:, None] + constants.arange(tree.depth)[None, :]).clamp(max=self.max_model_len - 1)
        if dynamic:  # every pass has top_k queries: their positions [depth, B * top_k] in one copy
            ahead = ahead.T[:, :, None].expand(-1, -1, tree.top_k).reshape(tree.depth, -1)
        cos, sin = self._rotary_grid(ahead, hidden.dtype)  # [depth, ..., 1, D/2]
        used = 0
        for depth in range(1, tree.depth):
            size = frontier_tokens.shape[1]
            bits = constants.get(("frontier bits", used, size), lambda u=used, n=size: self._bits(u, n))
            if dynamic:  # the window ends at the pass's last query: scratch index 0 at window bit `shift`
                shift = TREE_WINDOW - used - size
                if ancestors is None:  # depth 1: every node sees itself alone of the scratch keys, a constant
                    ancestors = bits.expand(count, -1)
                    masks = constants.get(("first masks", size), lambda b=bits, s=shift: self._window_masks(b, s))
                    masks = masks.expand(count, -1)
                else:  # (ancestors << shift) | the context's bits, in one op (an int64 product wraps as a shift)
                    ancestors = ancestors | bits
                    context = constants.get(("context bits", shift), lambda s=shift: self._context_bits(s))
                    masks = torch.add(context, ancestors, alpha=to_int64(1 << shift))
            else:
                masks = constants.get(("static masks", depth), lambda d=depth: self._static_masks(d))
                masks = masks.expand(count, -1)
            step = self._tree_step(block_table, seq_lens[depth], scratch[:, used : used + size], masks)
            if dynamic:
                positions, rotary = ahead[depth], (cos[depth], sin[depth])
            else:  # a static pass's nodes of one request share their position
                positions = ahead[:, depth : depth + 1].expand(-1, size).reshape(-1)
                rotary = (
                    cos[:, depth, None].expand(-1, size, -1, -1).reshape(count * size, *cos.shape[2:]),
                    sin[:, depth, None].expand(-1, size, -1, -1).reshape(count * size, *sin.shape[2:]),
                )
            out_hidden, out_head = self.drafter(
                frontier_tokens.reshape(-1), positions, frontier_hidden.reshape(count * size, -1),
                self.kv_cache.layers, step, rotary=rotary,
            )  # fmt: skip
            used += size
            branch = tree.top_k if dynamic else tree.branching[depth]
            log_probs, tokens = self.candidates.top(out_head, branch, dynamic, penalties)
            tokens = tokens.view(count, -1)
            pool_tokens.append(tokens)
            if dynamic:  # the top_k children by cumulative confidence go on
                scores = (frontier_scores[:, :, None] + log_probs.view(count, size, branch)).reshape(count, -1)
                pool_scores.append(scores)
                if depth == tree.depth - 1:  # the deepest level: nothing goes on
                    break
                frontier_scores, candidates = scores.topk(tree.top_k, dim=-1)
                slot_of_parent = candidates // branch
                frontiers.append(candidates)
                frontier_tokens = tokens.gather(1, candidates)
                ancestors = ancestors.gather(1, slot_of_parent)
                frontier_hidden = out_hidden.view(count, size, -1).gather(
                    1, slot_of_parent[:, :, None].expand(-1, -1, out_hidden.shape[-1])
                )
            elif depth < tree.depth - 1:  # every child goes on: node j of the next level is child j % b of j // b
                frontier_tokens = tokens
                spread = constants.get(("spread", size, branch), lambda n=size * branch, b=branch: self._spread(n, b))
                frontier_hidden = out_hidden.view(count, size, -1).index_select(1, spread)
        if not dynamic:
            parents = constants.get("static parents", self.candidates.static_parents_tensor)
            return torch.cat(pool_tokens, 1), parents.expand(count, -1)
        return self.candidates.dynamic_tree(pool_tokens, pool_scores, frontiers)

    def _written(self) -> torch.Tensor:
        """[depth]: scratch keys written after the pass at each depth (index 0 unused: depth 1 needs no pass)."""
        sizes = [self.tree.top_k] * self.tree.depth if self.tree.dynamic else [1, *self.tree.level_sizes]
        written = [0] * self.tree.depth
        for depth in range(1, self.tree.depth):
            written[depth] = written[depth - 1] + sizes[depth - 1 if self.tree.dynamic else depth]
        return torch.tensor(written, device=self.device)

    def _bits(self, used: int, size: int) -> torch.Tensor:
        """1 << (used + i) for the i-th query of a drafter pass: its own scratch key's bit."""
        return torch.ones(size, dtype=torch.int64, device=self.device) << self.constants.arange(size) + used

    def _window_masks(self, ancestors: torch.Tensor, shift: int) -> torch.Tensor:
        """Tree masks from ancestor bits over the scratch keys: every context key, and the ancestors' keys."""
        return (ancestors << shift) | to_int64((1 << shift) - 1)

    def _context_bits(self, shift: int) -> torch.Tensor:
        """The window bits below scratch index 0 (the context's keys), as a 0-d tensor."""
        return torch.tensor(to_int64((1 << shift) - 1), dtype=torch.int64, device=self.device)

    def _spread(self, count: int, branch: int) -> torch.Tensor:
        return self.constants.arange(count) // branch

    def _static_masks(self, depth: int) -> torch.Tensor:
        """[1, nodes] tree masks of a static tree's drafter pass at `depth` (its nodes at depth - 1 expanded):
        every context key, and of the scratch keys written so far the node's ancestors and itself."""
        branching = self.tree.branching
        ancestors, used = [0] * branching[0], 0
        for d in range(1, depth + 1):
            ancestors = [a | 1 << (used + i) for i, a in enumerate(ancestors)]
            if d == depth:
                break
            used += len(ancestors)
            ancestors = [ancestors[j // branching[d]] for j in range(len(ancestors) * branching[d])]
        shift = TREE_WINDOW - used - len(ancestors)  # window bit of scratch index 0: the window ends at the last query
        masks = [to_int64((a << shift) | ((1 << shift) - 1)) for a in ancestors]
        return torch.tensor([masks], dtype=torch.int64, device=self.device)

    def _tree_step(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor, masks: torch.Tensor
    ) -> AttentionStep:
        """The metadata of one drafter pass: per request `slots.shape[1]` queries, the newest scratch keys (slots
        past the newest verified token); `masks` [B, queries] their tree masks, `seq_lens` [B] int32."""
        count, size = slots.shape
        return AttentionStep(
            backend=self.backend,
            block_table=block_table,
            query_start_loc=self.constants.starts(count, size),
            seq_lens=seq_lens,
            slot_mapping=slots.reshape(-1),
            max_query_len=size,
            max_seq_len=self.max_model_len,
            causal=True,
            tree_mask=masks.reshape(-1),
        )
