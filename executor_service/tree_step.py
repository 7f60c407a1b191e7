"""The tree step on the device: verify a tree of drafts, accept its longest matching path, move that path's K/V
into place and draft the next trees in one function, read back once (the chain's is spec_step.py).

When every request of a step (greedy or sampled, penalised or asking for logprobs) verifies a whole tree of the
loaded shape (N drafts, depth D), nothing between the target's verify pass and the next trees needs the host. Every
tensor has a fixed shape per tree shape, so the function is captured as one CUDA graph per batch bucket
(cuda_graphs.StepGraphs) and runs eagerly elsewhere (the CPU, larger batches). The parts, as the engine's host
path does them:

- layout (`tree_layout`): each row's depth and ancestor bits from the drafts' parents [B, N] (D rounds of
  gathers); the verify pass's positions (root + depth) and tree masks (kernels/tree_mask.py) follow from them.
- verify (`verifier.verify`): a draft hits by the greedy rule (the target's argmax at its parent's row) or the
  sampled rule (multi-candidate speculative sampling); of siblings the first that hits is taken, and a draft is
  accepted when it and all its ancestors are. The accepted drafts form one path, read out by depth.
- accept: the path's K/V moves from its rows' slots to the slots of root + depth, every layer in one gather and
  one scatter with device indices (the entries past the path copy one untouched slot onto itself, so the
  shapes stay fixed).
- propose: the drafter's context pass over the root and the path rows (D + 1 rows: those past the path land
  past the verified tokens, where the drafter's passes write over them), then TreeProposer.draft_tree from the
  newest verified row.

Read back per request, one packed tensor: [emitted (D + 1; the first accepted + 1 count) | accepted |
next tokens (N) | next parents (N)], and for the extras variants the emitted tokens' logprobs
(device_penalties.py). Cut-short trees take the host path.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from executor_service.attention_step import AttentionStep
from executor_service.cuda_graphs import StepGraphs
from executor_service.device_sampling import GREEDY, SamplingTensors, sorts
from executor_service.model_runner import ModelRunner, StepInputs
from executor_service.parallel.driver import TensorParallelModel
from executor_service.request import Request
from executor_service.spec_step import PendingStep, VerifiedStep
from executor_service.step_constants import StepConstants
from executor_service.step_variants import DEFAULT_PENALTY_SLOTS, StepSampling, VariantSteps, capture_variants
from executor_service.tree_proposer import TreeProposer, static_parents
from executor_service.verifier import DraftLayout, tree_layout, verify
from kernels.tree_mask import TREE_WINDOW, to_int64


class TreeStep(VariantSteps):
    def __init__(self, runner: ModelRunner, proposer: TreeProposer, penalty_slots: int = DEFAULT_PENALTY_SLOTS) -> None:
        super().__init__(runner.model.config.vocab_size, runner.device, penalty_slots)
        self.runner, self.proposer, self.tree = runner, proposer, proposer.tree
        self.num_drafts, self.depth = self.tree.num_drafts, self.tree.depth
        self.rows = self.num_drafts + 1  # the root and the drafts
        self.scratch_width = proposer.scratch_width  # keys the drafter's tree passes write
        self.ahead_width = self.depth + self.scratch_width  # slots of positions root + 1, ..., wherever the path ends
        self.constants = StepConstants(runner.device)
        # A static tree is drafted in one layout: its depths, ancestors and masks are constants, not D rounds of
        # gathers per step (the first step's host-given trees are checked against it in `accepts`).
        self.static_parents = None if self.tree.dynamic else static_parents(self.tree)
        self.static_layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if self.static_parents is not None:
            parents = torch.tensor([self.static_parents], dtype=torch.int64, device=runner.device)
            node_depth, ancestors = tree_layout(parents, self.depth)
            self.static_layout = (node_depth, ancestors, self._masks(ancestors))

    def accepts(self, inputs: StepInputs, requests: list[Request]) -> bool:
        """Every request verifies a whole tree (N drafts, all rows sampled; a static tree in its drafted layout),
        greedy or sampled, penalised or not (while the penalty table has slots); tensor parallelism keeps the
        host path (its K/V move is an op on every rank)."""
        if inputs.uniform_query_len != self.rows or isinstance(self.runner.model, TensorParallelModel):
            return False
        if not self.fits(requests):
            return False
        for request in requests:
            parents = self.proposer.tree_of(request)
            if len(parents) != self.num_drafts:
                return False
            if self.static_parents is not None and parents != self.static_parents:
                return False
        return True

    def reach(self, request: Request) -> int:
        """Positions a request needs room for: the verify rows up to root + N and the drafter's keys up to
        root + D + num_inputs (the path's length is known only on the device)."""
        return request.num_computed_tokens + 1 + max(self.num_drafts, self.ahead_width)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, requests: list[Request]) -> PendingStep:
        """Queue the step and its read-back; returns without waiting for either. `inputs`: runner.prepare's
        (consecutive positions and slots from the root; the tree positions and masks are built on the device)."""
        # The block table as reserved up to `reach` (the drafter's keys may pass the blocks the step was built with).
        step = replace(inputs.attention, block_table=self.proposer.block_table(requests))
        roots = inputs.positions.view(len(requests), self.rows)[:, 0]
        ahead = self._slots(step.block_table, roots + 1, self.ahead_width)
        parents = self.proposer.tensor([self.proposer.tree_of(r) for r in requests], torch.int64)
        sampling = StepSampling.of(requests, self.table)
        x = {"input_ids": inputs.input_ids, "parents": parents, "slots_ahead": ahead, **sampling.inputs}
        (packed,) = self.run(sampling.variant, "", step, inputs.positions, x)
        return PendingStep(packed, inputs.positions, self.depth + 1, sampling, self.logprob_top)

    def next_tree(self, result: VerifiedStep, index: int) -> tuple[list[int], list[int] | None]:
        """Request `index`'s next tree as the proposer takes it: its tokens, then its parents."""
        tree_ids = result.next_drafts[index]
        return tree_ids[: self.num_drafts], tree_ids[self.num_drafts :]

    def reach_following(self, request: Request) -> int:
        """Positions a request needs room for before the step after its current one is launched blind: this
        step may accept D drafts, and the next one writes from one past there."""
        return self.reach(request) + self.depth + 1

    @torch.inference_mode()
    def launch_following(self, previous: PendingStep, requests: list[Request]) -> PendingStep:
        """Queue the step after `previous` for the same requests before the host has read `previous` back: its
        inputs (the bonus token and the next tree), positions, sequence lengths and slots follow on the device
        from `previous`'s packed result. The caller has reserved every request's blocks up to `reach_following`."""
        count, rows, depth, size = len(requests), self.rows, self.depth, self.num_drafts
        roots = [r.num_computed_tokens for r in requests]  # `previous`'s root (not yet booked)
        block_table = self.proposer.block_table(requests)
        old_root = previous.positions.view(count, rows)[:, 0]
        wide = self._slots(block_table, old_root, depth + 2 + max(rows, self.ahead_width))
        packed = previous.packed
        accepted = packed[:, depth + 1]
        bonus = packed[:, : depth + 1].gather(1, accepted[:, None])
        input_ids = torch.cat([bonus, packed[:, depth + 2 : depth + 2 + size]], dim=1).reshape(-1)
        parents = packed[:, depth + 2 + size : depth + 2 + 2 * size]
        shift = accepted[:, None] + 1  # the new root's offset from the old one
        root = old_root + accepted + 1
        offsets = self.constants.arange(max(rows, self.ahead_width))[None, :]
        positions = (root[:, None] + offsets[:, :rows]).reshape(-1)
        slot_mapping = wide.gather(1, shift + offsets[:, :rows]).reshape(-1)
        slots_ahead = wide.gather(1, shift + 1 + offsets[:, : self.ahead_width])
        step = AttentionStep(
            backend=self.runner.backend, block_table=block_table, query_start_loc=self.constants.starts(count, rows),
            seq_lens=(root + rows).to(torch.int32), slot_mapping=slot_mapping, max_query_len=rows,
            max_seq_len=max(roots) + depth + 1 + rows,
        )  # fmt: skip
        sampling = previous.sampling
        x = {"input_ids": input_ids, "parents": parents, "slots_ahead": slots_ahead, **sampling.inputs}
        (out,) = self.run(sampling.variant, " following", step, positions, x)
        return PendingStep(out, positions, depth + 1, sampling, self.logprob_top)

    def _slots(self, block_table: torch.Tensor, first: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] cache slots of positions first, first + 1, ... of each request, on the device (no host loop
        over the slots); every one of them reserved by the caller."""
        size = self.runner.block_size
        positions = first[:, None] + self.constants.arange(width)[None, :]
        blocks = block_table.long().gather(1, (positions // size).clamp(max=block_table.shape[1] - 1))
        return blocks * size + positions % size

    def forward(
        self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor], variant: str = GREEDY
    ) -> tuple:
        """[B, (D + 1) + 1 + 2N]: see the module's docstring. `positions`: root, root + 1, ... per request."""
        input_ids, parents = x["input_ids"], x["parents"]
        count, rows = parents.shape[0], self.rows
        root = positions.view(count, rows)[:, 0]
        if self.static_layout is not None:
            node_depth, ancestors, masks = (t.expand(count, -1) for t in self.static_layout)
        else:
            node_depth, ancestors = tree_layout(parents, self.depth, self.constants)
            masks = self._masks(ancestors)
        verify_step = AttentionStep(
            backend=step.backend, block_table=step.block_table, query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens, slot_mapping=step.slot_mapping, max_query_len=rows,
            max_seq_len=step.max_seq_len, causal=True, tree_mask=masks.reshape(-1),
        )  # fmt: skip
        tree_positions = (root[:, None] + node_depth).reshape(-1)
        logits, features = self.runner.forward(input_ids, tree_positions, verify_step, None)
        assert features is not None, "a drafter reads the target's features"
        layout = DraftLayout(input_ids.view(count, rows)[:, 1:], parents, node_depth, ancestors, self.depth)
        sampling, penalties = SamplingTensors.from_inputs(x), self.step_penalties(x)
        verdict = verify(logits, layout, sampling, root, sorts(variant), self.constants, penalties)
        path_rows, accepted, emitted = verdict.path_rows, verdict.accepted, verdict.emitted
        extras = self.extras(logits, verdict, penalties, self.constants, rows)
        slots = step.slot_mapping.view(count, rows)
        self._move_path(slots, path_rows, accepted)
        next_tokens, next_parents = self._propose(step, slots, features, root, path_rows, accepted, emitted, x)
        return (torch.cat([emitted, accepted[:, None], next_tokens, next_parents, *extras], dim=1),)

    def _masks(self, ancestors: torch.Tensor) -> torch.Tensor:
        """The verify rows' tree masks: every context key, and of the window's last `rows` keys the ancestors."""
        first = TREE_WINDOW - self.rows  # window bit of row 0 (kernels/tree_mask.py)
        return (ancestors << first) | to_int64((1 << first) - 1)

    def _move_path(self, slots: torch.Tensor, path_rows: torch.Tensor, accepted: torch.Tensor) -> None:
        """The accepted draft at depth d: its K/V from its row's slot to the slot of root + d, every layer."""
        levels = self.constants.arange(self.depth + 1)[None, 1:]
        source, target = slots.gather(1, path_rows[:, 1:]), slots[:, 1 : self.depth + 1]
        # A padded request (graph buckets) has every slot -1: its root's tells; a real one's slots are all set.
        moves = (levels <= accepted[:, None]) & (slots[:, :1] >= 0)
        anchor = slots[:1, :1]  # the first request's root: no move reads or writes it
        src, dst = torch.where(moves, source, anchor).reshape(-1), torch.where(moves, target, anchor).reshape(-1)
        storage = self.runner.kv_cache.storage  # [layers, 2, blocks, block_size, heads, head_size], one allocation
        by_slot = storage.view(storage.shape[0] * 2, -1, *storage.shape[4:])  # every layer's K and V by slot
        by_slot[:, dst] = by_slot[:, src]  # two kernels for all layers (copy_kv_slots: two per layer, K and V)

    def _propose(
        self, step: AttentionStep, slots: torch.Tensor, features: torch.Tensor, root: torch.Tensor,
        path_rows: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor, x: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The next trees: the drafter's context pass over the root and path rows at root, root + 1, ...
        (row i pairs with emitted token i), then the tree drafted from the newest verified row."""
        proposer, count, width = self.proposer, root.shape[0], self.depth + 1
        offsets = self.constants.arange(width)
        context = AttentionStep(
            backend=proposer.backend, block_table=step.block_table,
            query_start_loc=self.constants.starts(count, width),
            seq_lens=step.seq_lens - (self.rows - width), slot_mapping=slots[:, :width].reshape(-1),
            max_query_len=width, max_seq_len=proposer.max_model_len,
        )  # fmt: skip
        rows = (self.constants.strided(count, self.rows)[:, None] + path_rows).reshape(-1)
        positions = (root[:, None] + offsets).reshape(-1)
        feedback, head = proposer.context_pass_rows(context, positions, emitted.reshape(-1), features[rows])
        picked = self.constants.strided(count, width) + accepted  # the newest verified row
        scratch_offsets = self.constants.arange(self.scratch_width)
        scratch = x["slots_ahead"].gather(1, accepted[:, None] + scratch_offsets[None, :])
        return proposer.draft_tree(step.block_table, root + accepted, scratch, head[picked], feedback[picked])

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """One graph per sampling variant and batch bucket (target and drafter backends both capture-safe: the
        session checks)."""

        def build(variant: str, request_inputs: dict) -> StepGraphs:
            return StepGraphs(
                f"tree step ({self.tree.describe()}, {variant})", functools.partial(self.forward, variant=variant),
                self.runner.backend, self.rows, max_batch, max_model_len, self.runner.block_size, self.runner.device,
                {"input_ids": ((), torch.int64)}, request_inputs=request_inputs,
            )  # fmt: skip

        base = {"parents": ((self.num_drafts,), torch.int64, -1), "slots_ahead": ((self.ahead_width,), torch.int64, -1)}
        self.graphs = capture_variants(build, base)
