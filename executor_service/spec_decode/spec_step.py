"""The speculative step on the device: verify, accept and propose in one pass, read back once, for chains and
trees alike (a chain is the tree whose draft j has parent j - 1).

When every request of a step verifies a whole draft of the loaded shape (the steady state of speculative
decoding), greedy or sampled, penalised or asking for logprobs, nothing between the target's verify pass and the
drafter's next proposal needs the host:

- layout: a chain's is constant and its drafts attend causally at their own positions; a tree's depths,
  ancestors and masks (kernels/tree_mask.py) are constants for a static shape and `tree_layout` of the drafted
  parents for a dynamic one, its drafts at the root's position plus their depth;
- verify and accept (`verifier.verify`): the greedy rule accepts drafts equal to the target's argmax at their
  parent's row, the sampled rule draws (counter-based: device_sampling.py); the accepted drafts form one path;
- roll back (`VerifiedStep.kept_rows`): the rejected drafts' K/V stays in the cache but is not booked, and the
  next step overwrites it; a tree's path K/V first moves to the slots of its positions (a chain's is in place);
- propose (`Proposer.propose_verified`): the drafter's context pass over the root and the path, then its next
  drafts from the newest verified row, each pass's metadata advanced on the device from the slots ahead of the
  root that the host lays out before the step.

So the parts run as one function, captured as CUDA graphs per sampling variant and batch bucket
(step_variants.py): one replay per step and one read-back per request of [emitted tokens (depth + 1) | accepted
count | next drafts (N) | their parents (N, dynamic trees only)], and for the extras variants the emitted tokens'
logprobs (device_penalties.py). `launch_following` derives the next step's inputs on the device from that packed
result, so it is launched before the host reads this one back. The same function runs eagerly on the CPU and for
batches larger than the graphs. Drafts drawn from q (`draws`, chains): the sampled variants carry each request's q
in ([B, k, 32] ids and probabilities) and the next drafts' q out, the drafter drawing inside the step
(draft_sampling.StepDraws). The engine's host path (host_step.py) takes the rest: uneven batches, cut-short
trees, penalised requests past the penalty table's slots.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field, replace

import torch

from executor_service.engine.request import Request
from executor_service.models.attention_step import AttentionStep, to_device
from executor_service.parallel.graphs import lockstep_for
from executor_service.runner.cuda_graphs import StepGraphs
from executor_service.runner.host_copy import HostCopy
from executor_service.runner.model_runner import ModelRunner, StepInputs
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.device_sampling import GREEDY, SamplingTensors, StepKeys, has_extras, sorts
from executor_service.sample.logprobs import TokenLogprob
from executor_service.sample.sampling import DraftProbs
from executor_service.spec_decode.device_penalties import unpack_logprobs
from executor_service.spec_decode.draft_penalties import DraftPenalties
from executor_service.spec_decode.draft_sampling import StepDraws
from executor_service.spec_decode.host_verify import DraftTree
from executor_service.spec_decode.proposer import DeviceReplay, Proposer
from executor_service.spec_decode.step_variants import (
    DEFAULT_PENALTY_SLOTS,
    StepSampling,
    VariantSteps,
    capture_variants,
)
from executor_service.spec_decode.tree_drafting import static_parents
from executor_service.spec_decode.verifier import DraftLayout, DraftQ, tree_layout, verify
from kernels.tree_mask import TREE_WINDOW, to_int64


@dataclass(frozen=True)
class VerifiedStep:
    """What the host reads back of one device-resident step, per request."""

    target_ids: list[
        list[int]
    ]  # the emitted tokens: the accepted drafts, then the token after them (num_steps + 1 wide)
    accepted: list[int]  # drafts accepted
    next_drafts: list[list[int]]  # the drafter's num_draft_tokens drafts for the next step
    logprobs: torch.Tensor | None = None  # an extras step's packed logprobs [B, ...] (device_penalties.py)
    logprob_top: int = 0
    penalised: list[bool] = field(default_factory=list)
    draft_q: DraftQ | None = None  # the next drafts' q [B, k, K] on the device (drafts drawn from q), else None

    def draft_probs(self, index: int, greedy: bool) -> DraftProbs | None:
        """Request `index`'s next drafts' q (None: point masses, as a greedy request's always are)."""
        if self.draft_q is None or greedy:
            return None
        return DraftProbs(self.draft_q.ids[index], self.draft_q.probs[index])

    def emitted(self, index: int) -> list[int]:
        """The accepted drafts and the token after them."""
        return self.target_ids[index][: self.kept_rows(index)]

    def kept_rows(self, index: int) -> int:
        """Roll back: of the rows verified, the request keeps its last token's and its accepted drafts';
        the rejected drafts' K/V is not counted, and the next step writes over it."""
        return self.accepted[index] + 1

    def token_logprobs(self, index: int, n: int | None) -> list[TokenLogprob] | None:
        """The emitted tokens' logprobs with the top n (None: the request asks for none)."""
        if n is None or self.logprobs is None:
            return None
        return unpack_logprobs(self.logprobs[index], self.emitted(index), self.logprob_top, n)


@dataclass(frozen=True)
class FollowingInputs:
    """What the step launched after a pending one reads of it, for part of its batch (`PendingStep.narrowed`)."""

    packed: torch.Tensor
    positions: torch.Tensor
    sampling: StepSampling
    draft_q: DraftQ | None


class PendingStep:
    """A launched step's packed result [B, (num_steps + 1) + 1 + num_draft_tokens (+ a dynamic tree's parents)],
    copied to pinned host memory behind the step; its packed result, positions and sampling inputs stay on the
    device for the step launched after it (`launch_following`). An extras step's packed logprobs (rows x (1 + 2
    top) columns) end each row. Drafts drawn from q: their q [B, k, K] stays on the device (copied out of the
    graph's buffers, which the step launched after this one overwrites)."""

    def __init__(
        self,
        packed: torch.Tensor,
        positions: torch.Tensor,
        rows: int,
        sampling: StepSampling | None = None,
        logprob_top: int = 0,
        draft_q: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.packed, self.positions, self.sampling = packed, positions, sampling or StepSampling()
        self.draft_q = DraftQ(draft_q[0].clone(), draft_q[1].clone()) if draft_q else None
        self.rows, self.width = rows, packed.shape[1]
        self.logprob_top = logprob_top if has_extras(self.sampling.variant) else 0
        self.logprob_width = rows * (1 + 2 * logprob_top) if self.logprob_top else 0
        self.readback = HostCopy(packed)

    def narrowed(self, kept: list[int]) -> FollowingInputs:
        """What a following step reads of this one for its requests `kept` (indices into this step's batch, in
        order): their packed rows, positions, sampling inputs and drafts' q, gathered on the device. The kept
        requests' variant serves them: a batch's variant covers every need of its requests."""
        index = to_device(kept, torch.int64, self.packed.device)
        rows = self.positions.shape[0] // self.packed.shape[0]
        positions = self.positions.view(-1, rows).index_select(0, index).reshape(-1)
        inputs = {name: tensor.index_select(0, index) for name, tensor in self.sampling.inputs.items()}
        draft_q = None
        if self.draft_q is not None:
            draft_q = DraftQ(self.draft_q.ids.index_select(0, index), self.draft_q.probs.index_select(0, index))
        sampling = StepSampling(self.sampling.variant, inputs)
        return FollowingInputs(self.packed.index_select(0, index), positions, sampling, draft_q)

    def result(self) -> VerifiedStep:
        """Waits for the device (runner/host_copy.py)."""
        host = self.readback.wait()
        end = self.width - self.logprob_width
        per_request = host[:, :end].tolist()
        rows = self.rows
        return VerifiedStep(
            target_ids=[r[:rows] for r in per_request],
            accepted=[r[rows] for r in per_request],
            next_drafts=[r[rows + 1 :] for r in per_request],
            logprobs=host[:, end:] if self.logprob_width else None,
            logprob_top=self.logprob_top,
            draft_q=self.draft_q,
        )


class SpecStep(VariantSteps):
    def __init__(self, runner: ModelRunner, proposer: Proposer, penalty_slots: int = DEFAULT_PENALTY_SLOTS) -> None:
        super().__init__(runner.model.config.vocab_size, runner.device, penalty_slots)
        self.runner, self.proposer, self.tree = runner, proposer, proposer.tree
        chain = self.tree is None
        self.num_steps = proposer.num_steps  # drafter steps: a chain's length, a tree's depth
        self.num_draft_tokens = proposer.num_draft_tokens  # drafts verified per request
        self.rows = self.num_draft_tokens + 1  # the root and the drafts
        self.dynamic = self.tree is not None and self.tree.dynamic  # its parents are drafted, not constant
        self.tree_depth = 0 if self.tree is None else self.num_steps  # a tree's path moves num_steps drafts' K/V
        self.ahead_width = proposer.ahead_width  # slots of positions root, root + 1, ... its passes may write
        self.constants = StepConstants(runner.device)
        # A chain's or a static tree's drafts keep one layout: its parents, depths, ancestors and masks are
        # constants, not rounds of gathers per step (the host-given drafts are checked against it in `accepts`).
        self.static_parents: list[int] | None = None
        if self.tree is None:
            self.static_parents = list(range(-1, self.num_steps - 1))
        elif not self.tree.dynamic:
            self.static_parents = static_parents(self.tree)
        self.static_layout: tuple[torch.Tensor, ...] | None = None
        self.captured_replay: DeviceReplay | None = None  # the proposer's device_replay when the graphs were captured
        self.vocab_ids = proposer.draft_vocab_ids()  # drawn drafts' q ids in the target's vocabulary
        if not chain and self.static_parents is not None:
            parents = torch.tensor([self.static_parents], dtype=torch.int64, device=runner.device)
            node_depth, ancestors = tree_layout(parents, self.num_steps)
            self.static_layout = (parents, node_depth, ancestors, self._masks(ancestors))
        # The deepest draft of each prefix of the static layout (a chain's prefix of n drafts: depth n).
        self.prefix_depths = list(itertools.accumulate(DraftTree([], self.static_parents or []).depths(), max))

    def describe(self) -> str:
        return f"chain, k = {self.num_steps}" if self.tree is None else self.tree.describe()

    def replays(self, variant: str, graphs: StepGraphs) -> bool:
        """A sampled variant's graph was captured for one drafting rule (drawn: it reads each request's q); under
        the other one (a test or benchmark switching `sample_drafts` after the load) the step runs eagerly. So it
        does when the proposer's `device_replay` is not the one the graphs captured."""
        if self.proposer.device_replay is not self.captured_replay:
            return False
        return variant == GREEDY or ("q_ids" in graphs.request_inputs) == self.draws

    @property
    def draws(self) -> bool:
        """Whether a chain's sampled requests draw their drafts from q in this step (`Proposer.sample_drafts`);
        the sampled variants then carry each request's q in and the next drafts' q out."""
        return self.tree is None and self.proposer.samples_drafts()

    def accepts(self, inputs: StepInputs, requests: list[Request]) -> bool:
        """Every request verifies a whole draft of the loaded shape (all rows sampled) that the step takes
        (`takes`), while the penalty table has slots for the penalised ones. Otherwise the host path runs the
        step, or the part of it the step does not take (engine/step_parts.py)."""
        if inputs.uniform_query_len != self.rows or not self.fits(requests):
            return False
        return all(self.takes(r) for r in requests)

    def takes(self, request: Request) -> bool:
        """Whether the step verifies this request's drafts: greedy or sampled, drawn from q where the step draws
        (`draws`) or argmax drafts; a tree's in the loaded layout, whole (not cut short)."""
        if self.tree is None:
            return self.draws or request.draft_probs is None
        parents = self.proposer.tree_of(request)
        if len(parents) != self.num_draft_tokens:
            return False
        return self.static_parents is None or parents == self.static_parents

    def reach(self, request: Request) -> int:
        """Positions a request needs room for: its verify rows, and the drafter's keys past the root (the path's
        length is known only on the device)."""
        return request.num_computed_tokens + max(self.rows, self.ahead_width)

    def reach_following(self, request: Request) -> int:
        """Positions a request needs room for before the step after its current one is launched blind: this
        step may accept `num_steps` drafts, and the next one writes from one past there."""
        return self.reach(request) + self.num_steps + 1

    def next_tree(self, result: VerifiedStep, index: int) -> tuple[list[int], list[int] | None]:
        """Request `index`'s next drafts as the proposer takes them: its tokens and parents (a chain's: None)."""
        ids = result.next_drafts[index]
        if self.tree is None:
            return ids[: self.num_draft_tokens], None
        size = self.num_draft_tokens
        parents = ids[size : 2 * size] if self.dynamic else self.static_parents
        return ids[:size], parents

    def depth_of(self, request: Request) -> int:
        """The deepest of the drafts a request verified in a device step: read off the constant layout for a
        chain or a static tree (no per-request walk on the booking's path), walked for a dynamic tree."""
        count = len(request.draft_ids)
        if not self.dynamic:
            return self.prefix_depths[count - 1] if count else 0
        return max(DraftTree(request.draft_ids, self.proposer.tree_of(request)).depths(), default=0)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, requests: list[Request]) -> PendingStep:
        """Queue the step and its read-back; returns without waiting for either. `inputs`: runner.prepare's
        (consecutive positions and slots from the root; a tree's positions and masks are built on the device).
        The caller has reserved every request's blocks up to `reach`."""
        roots = [r.num_computed_tokens for r in requests]
        step = replace(inputs.attention, block_table=self.proposer.block_table(requests))  # as reserved
        sampling = StepSampling.of(requests, self.table)
        x = {"input_ids": inputs.input_ids, **sampling.inputs}
        x["slots_ahead"] = self.proposer.slots_ahead(requests, roots, self.ahead_width)
        if self.dynamic:
            x["parents"] = self.proposer.tensor([self.proposer.tree_of(r) for r in requests], torch.int64)
        if self.draws and sampling.variant != GREEDY:
            drafts = inputs.input_ids.view(len(requests), self.rows)[:, 1:]
            q = DraftQ.build(drafts, [r.draft_probs for r in requests], self.proposer.q_width)
            x |= {"q_ids": q.ids, "q_probs": q.probs}
        packed, *draft_q = self.run(sampling.variant, "", step, inputs.positions, x)
        return PendingStep(packed, inputs.positions, self.num_steps + 1, sampling, self.logprob_top, tuple(draft_q))

    @torch.inference_mode()
    def launch_following(
        self, previous: PendingStep, requests: list[Request], kept: list[int] | None = None
    ) -> PendingStep:
        """Queue the step after `previous` for the same requests before the host has read `previous` back: its
        inputs (the bonus token and the next drafts), positions, sequence lengths and slots follow on the device
        from `previous`'s packed result. `kept`: the indices of `requests` in `previous`'s batch when some of it
        finished since its launch (None: all of it, in order); the rest is left out, its rows in `previous`
        unread. The caller has reserved every request's blocks up to `reach_following`."""
        source = previous if kept is None else previous.narrowed(kept)
        if kept is not None:
            self.counts["narrowed"] += 1  # launched for the requests still running after a finish
        count, rows, depth, size = len(requests), self.rows, self.num_steps, self.num_draft_tokens
        roots = [r.num_computed_tokens for r in requests]  # `previous`'s root (not yet booked)
        block_table = self.proposer.block_table(requests)
        old_root = source.positions.view(count, rows)[:, 0]
        reach = max(rows, self.ahead_width)
        wide = self._slots(block_table, old_root, depth + 1 + reach)
        packed = source.packed
        accepted = packed[:, depth + 1]
        bonus = packed[:, : depth + 1].gather(1, accepted[:, None])
        input_ids = torch.cat([bonus, packed[:, depth + 2 : depth + 2 + size]], dim=1).reshape(-1)
        shift = accepted[:, None] + 1  # the new root's offset from the old one
        root = old_root + accepted + 1
        offsets = self.constants.arange(reach)[None, :]
        positions = (root[:, None] + offsets[:, :rows]).reshape(-1)
        step = AttentionStep(
            backend=self.runner.backend, block_table=block_table, query_start_loc=self.constants.starts(count, rows),
            seq_lens=(root + rows).to(torch.int32), slot_mapping=wide.gather(1, shift + offsets[:, :rows]).reshape(-1),
            max_query_len=rows, max_seq_len=max(roots) + depth + 1 + rows,
        )  # fmt: skip
        sampling = source.sampling
        x = {"input_ids": input_ids, "slots_ahead": wide.gather(1, shift + offsets[:, : self.ahead_width])}
        if self.dynamic:
            x["parents"] = packed[:, depth + 2 + size : depth + 2 + 2 * size]
        if source.draft_q is not None:
            x |= {"q_ids": source.draft_q.ids, "q_probs": source.draft_q.probs}
        out, *draft_q = self.run(sampling.variant, " following", step, positions, x | sampling.inputs)
        return PendingStep(out, positions, depth + 1, sampling, self.logprob_top, tuple(draft_q))

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
        """The packed result (the module's docstring), and where drafts are drawn from q the next drafts' q ids
        and probabilities [B, k, K]. `positions`: root, root + 1, ... per request."""
        input_ids, ahead = x["input_ids"], x["slots_ahead"]
        count, rows = ahead.shape[0], self.rows
        root = positions.view(count, rows)[:, 0]
        layout, verify_step, verify_positions = self._layout(input_ids.view(count, rows)[:, 1:], x, step, positions)
        logits, features = self.runner.forward(input_ids, verify_positions, verify_step, None)  # the target's pass
        assert features is not None, "a drafter reads the target's features"
        sampling, penalties = SamplingTensors.from_inputs(x), self.step_penalties(x)
        q = DraftQ(x["q_ids"], x["q_probs"]) if "q_ids" in x else None
        keys = None
        if sampling is not None:
            keys = StepKeys.on_device(sampling.seed, root, layout.depth, q is not None, self.constants)
        verdict = verify(logits, layout, sampling, keys, sorts(variant), self.constants, penalties, q)
        extras = self.extras(logits, verdict, penalties, self.constants, rows)
        if not layout.chain:
            self._move_path(step.slot_mapping.view(count, rows), verdict.path_rows, verdict.accepted)
        draws = None
        if q is not None and sampling is not None:  # the first draft is for the position after the bonus token
            first = root + verdict.accepted + 2
            draws = StepDraws(sampling.params, sampling.seed, first, sorts(variant), self.vocab_ids, q.ids.shape[2])
        drafting = None  # the penalised requests' drafts picked under their penalties, the emitted tokens counted
        if penalties is not None:
            drafting = DraftPenalties.from_table(penalties, self.vocab_ids)
        next_tokens, next_parents = self.proposer.propose_verified(
            step, positions, features, verdict, ahead, draws, drafting
        )
        if self.proposer.device_replay is not None:  # a benchmark's scripted drafter, on the device
            bonus = verdict.emitted.gather(1, verdict.accepted[:, None])[:, 0]
            next_tokens = self.proposer.device_replay(bonus, next_tokens)
        parts = [verdict.emitted, verdict.accepted[:, None], next_tokens]
        if self.dynamic:
            assert next_parents is not None
            parts.append(next_parents)
        packed = torch.cat([*parts, *extras], dim=1)
        return (packed, *draws.q()) if draws is not None else (packed,)

    def _layout(
        self, drafts: torch.Tensor, x: dict[str, torch.Tensor], step: AttentionStep, positions: torch.Tensor
    ) -> tuple[DraftLayout, AttentionStep, torch.Tensor]:
        """The drafts' layout, the verify pass's metadata and positions (a chain's: the step's own, causal)."""
        count = drafts.shape[0]
        if self.tree is None:
            n = self.num_steps
            parents = self.constants.get(("chain", n), lambda: self.constants.arange(n) - 1)
            layout = DraftLayout(drafts, parents.expand(count, -1), None, None, n, chain=True)
            return layout, step, positions
        if self.static_layout is not None:
            parents, node_depth, ancestors, masks = (t.expand(count, -1) for t in self.static_layout)
        else:
            parents = x["parents"]
            node_depth, ancestors = tree_layout(parents, self.num_steps, self.constants)
            masks = self._masks(ancestors)
        verify_step = replace(step, causal=True, tree_mask=masks.reshape(-1), _flex=None)
        layout = DraftLayout(drafts, parents, node_depth, ancestors, self.num_steps)
        root = positions.view(count, self.rows)[:, 0]
        return layout, verify_step, (root[:, None] + node_depth).reshape(-1)

    def _masks(self, ancestors: torch.Tensor) -> torch.Tensor:
        """The verify rows' tree masks: every context key, and of the window's last `rows` keys the ancestors."""
        first = TREE_WINDOW - self.rows  # window bit of row 0 (kernels/tree_mask.py)
        return (ancestors << first) | to_int64((1 << first) - 1)

    def _move_path(self, slots: torch.Tensor, path_rows: torch.Tensor, accepted: torch.Tensor) -> None:
        """The accepted draft at depth d: its K/V from its row's slot to the slot of root + d, every layer."""
        levels = self.constants.arange(self.num_steps + 1)[None, 1:]
        source, target = slots.gather(1, path_rows[:, 1:]), slots[:, 1 : self.num_steps + 1]
        # A padded request (graph buckets) has every slot -1: its root's tells; a real one's slots are all set.
        moves = (levels <= accepted[:, None]) & (slots[:, :1] >= 0)
        anchor = slots[:1, :1]  # the first request's root: no move reads or writes it
        src, dst = torch.where(moves, source, anchor).reshape(-1), torch.where(moves, target, anchor).reshape(-1)
        self.runner.move_kv(src, dst)  # under tensor parallelism on every rank, in the graph where captured

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """One graph per sampling variant and batch bucket (target and drafter backends both capture-safe: the
        session checks)."""

        def build(variant: str, request_inputs: dict) -> StepGraphs:
            return StepGraphs(
                f"speculative step ({self.describe()}, {variant})", functools.partial(self.forward, variant=variant),
                self.runner.backend, self.rows, max_batch, max_model_len, self.runner.block_size,
                self.runner.device, {"input_ids": ((), torch.int64)}, request_inputs=request_inputs,
                lockstep=lockstep_for(self.runner.model, self.runner.feature_layers or (), self.tree_depth),
            )  # fmt: skip

        self.captured_replay = self.proposer.device_replay
        base = {"slots_ahead": ((self.ahead_width,), torch.int64, -1)}
        if self.dynamic:
            base["parents"] = ((self.num_draft_tokens,), torch.int64, -1)
        sampled = {}
        if self.draws:  # each request's q of its drafts (a padded request's: nothing drawn, nothing read)
            shape = (self.num_draft_tokens, self.proposer.q_width)
            sampled = {"q_ids": (shape, torch.int64, 0), "q_probs": (shape, torch.float32, 0)}
        self.graphs = capture_variants(build, base, sampled)
