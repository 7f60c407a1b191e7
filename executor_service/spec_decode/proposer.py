"""Proposers: after each target step, the drafter turns the target's features into the next drafts, a chain or a
tree (a chain is the tree whose every node has one child). One proposer per drafting method, over this base:
EAGLE and EAGLE-3 (eagle_proposer.py), DFlash (dflash_proposer.py).

The drafter has its own paged cache (its own layers, the target's block ids). Each proposal first runs the
drafter over the rows the target just computed (the "context pass": EAGLE's first step, DFlash's context K/V),
then drafts from the newest verified row:

- chains: num_steps drafts, one per position (EAGLE: num_steps - 1 more chain steps, one token per request;
  DFlash: one block pass). A chain's context pass runs every computed row, rejected ones too, so that steps have
  a fixed shape for CUDA graphs; their cache entries lie past the verified tokens and are overwritten before
  anything reads them. Each pass's attention metadata is rebuilt on the device (R10) from the newest verified
  position and the slots ahead of it, so a chain replays as CUDA graphs.
- trees: the context pass runs the verified rows at their final positions (the accepted path's, gathered), then
  the method drafts the tree (`draft_tree`: EAGLE pass by pass over the nodes it expands, DFlash from one block
  pass), its candidates and a dynamic tree's choice shared (tree_drafting.py).

Two entry points: `propose` (the host knows which rows were verified: after a prefill chunk, an uneven batch)
and `propose_verified` (verification computed on the device, inside the speculative step: see spec_step.py). A
chain drafts the argmax for greedy requests and, where `sample_drafts` is on, draws from the drafter's
distribution for sampled ones (draft_sampling.py): on the host path eagerly, in the device step inside its graph.
A penalised request picks its drafts under the penalties that verify them (draft_penalties.py), one picker
(`_picker`) on both paths.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_service.engine.kv_cache import KVCache
from executor_service.engine.request import Request
from executor_service.models.attention_step import (
    AttentionStep,
    block_table_tensor,
    build_attention_step,
    cache_slot,
    cache_slots,
    to_device,
)
from executor_service.models.draft_models import Drafter
from executor_service.models.fused_ops import argmax
from executor_service.runner.cuda_graphs import RequestInputs, StepGraphs, TokenInputs
from executor_service.runner.prefill_graphs import BatchPrefillGraphs, PrefillGraphs, prefill_buckets
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.sampling import DraftProbs, to_host
from executor_service.spec_decode.draft_penalties import DraftPenalties
from executor_service.spec_decode.draft_sampling import DRAFT_SUPPORT, DraftSampler, StepDraws
from executor_service.spec_decode.tree_drafting import TreeCandidates, draft_vocab_ids
from executor_service.spec_decode.verifier import Verdict

Replay = Callable[[Request, list[int]], list[int]]  # test drafters: rewrite a request's drafts
TreeReplay = Callable[[Request, list[int], list[int]], tuple[list[int], list[int]]]  # test drafters: rewrite a tree
# `replay`'s rule on the device step: (each request's bonus token [B], its next drafts [B, N]) -> the drafts.
DeviceReplay = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PassForward = Callable[[AttentionStep, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
# (block table, one position per request, inputs) -> outputs: a pass that builds its metadata on the device
OwnMetadataForward = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
Pick = Callable[[torch.Tensor], torch.Tensor]  # the head's hidden states [B, (n,) H] -> draft ids [B, (n)] (target)


@dataclass(slots=True)
class ProposeEntry:
    """One request that ran in the target step just verified and is still running. A value, never changed once
    made (not frozen: a frozen dataclass takes 4x as long to build, and the engine builds one per request a step)."""

    request: Request
    row_start: int  # its first row among the target step's rows (into the features)
    num_rows: int  # rows the target computed for it
    verified_rows: list[int]  # of which verified, in order (prefill chunk: all; verify: the root and its path)
    propose: bool  # has a new last token: draft for the next step (not a prefill chunk mid-prompt)

    @property
    def num_valid(self) -> int:
        return len(self.verified_rows)

    @property
    def first_position(self) -> int:
        return self.request.num_computed_tokens - self.num_valid


@dataclass
class ProposeBatch:
    entries: list[ProposeEntry]
    features: torch.Tensor  # [T, F] what the drafter reads of every target row
    # reserve(request, positions): secures the cache slots a proposal writes past the request's tokens (trees);
    # None: the scheduler reserved them with the step.
    reserve: Callable[[Request, int], bool] | None = None


@dataclass(frozen=True)
class DraftPass:
    """A drafter pass a graph can replay: its forward, query tokens per request and its inputs. Passes
    that build their own metadata on the device read only the block table of the step they are given."""

    forward: PassForward
    query_len: int
    inputs: TokenInputs
    request_inputs: RequestInputs | None = None


class Proposer:
    """What every drafting method shares; a method supplies its passes (`_passes`), its chain (`_draft_chain`,
    `_propose_verified_chain`), its tree (`context_pass_rows`, `draft_tree`, `scratch_width`)."""

    CONTEXT_PASS = ""  # the name of the method's context pass among its passes

    def __init__(
        self, drafter: Drafter, kv_cache: KVCache, backend: str, max_model_len: int, device: torch.device
    ) -> None:
        self.drafter, self.kv_cache, self.backend = drafter, kv_cache, backend
        self.config = drafter.config
        self.num_steps = self.config.num_steps  # drafter steps: a chain's length, a tree's depth
        self.num_draft_tokens = self.config.num_draft_tokens  # drafts verified per step
        self.tree = self.config.tree  # None: a chain
        self.block_size = kv_cache.block_size
        self.max_model_len, self.device = max_model_len, device
        self.constants = StepConstants(device)
        self.candidates = None if self.tree is None else TreeCandidates(self.tree, drafter, self.constants, device)
        self.parents: dict[str, list[int]] = {}  # a tree's drafts' parents, by request id
        self.replay: Replay | None = None
        self.replay_tree: TreeReplay | None = None  # scripted trees need the host: no step launched ahead
        # `replay`'s rule written for the device step too (benchmarks' always-right drafter), set before its graphs
        # are captured: the step applies it to its drafts on the device, so steps launch ahead as a drafter's do.
        self.device_replay: DeviceReplay | None = None
        # Sampled requests' drafts: True drawn from q (draft_sampling.py; on the device step and the host path
        # alike), False or None (auto) the argmax, verified as point masses (verifier.py). The rule does not depend
        # on CUDA graphs; auto is the argmax for every method, the faster at T = 0.7 (docs/executor.md).
        self.sample_drafts: bool | None = None
        self.draft_support = DRAFT_SUPPORT  # ids each drawn draft's q keeps (draft_sampling.py)
        self.pass_counts: Counter[str] = Counter()  # "<pass> graph" / "<pass> eager" (benchmarks read it)
        self.graphs: dict[str, StepGraphs] = {}  # by pass name; see capture_graphs
        self.prefill_graphs: PrefillGraphs | None = None  # a lone request's context pass (capture_prefill_graphs)
        self.batch_prefill_graphs: BatchPrefillGraphs | None = None  # several requests' (capture_batch_prefill_graphs)
        self.passes = self._passes()

    @property
    def ahead_width(self) -> int:
        """Slots of the positions a device step's proposal may write, from the root (the first verify row) on: a
        chain's num_draft_tokens + 1 verify rows and the drafter's lookahead; a tree's path, then its scratch keys."""
        if self.tree is None:
            return self.num_draft_tokens + 1 + self.config.positions_ahead
        return 1 + self.tree.depth + self.scratch_width

    @property
    def scratch_width(self) -> int:
        """Keys a tree proposal's drafter passes write past the newest verified token."""
        raise NotImplementedError

    def slot(self, request: Request, position: int) -> int:
        """Cache slot of `position`, -1 past the context or the request's blocks (written nowhere)."""
        if position >= self.max_model_len:
            return -1
        return cache_slot(request.block_ids, position, self.block_size)

    def slots(self, request: Request, start: int, stop: int) -> list[int]:
        """`slot` of positions start, ..., stop - 1, a range per block (a context pass's rows)."""
        inside = min(stop, max(start, self.max_model_len))
        return cache_slots(request.block_ids, start, inside, self.block_size) + [-1] * (stop - inside)

    def slots_ahead(
        self, requests: list[Request], starts: list[int], width: int, own: list[int] | None = None
    ) -> torch.Tensor:
        """[B, width] slots of positions start, start + 1, ... of each request: what its next passes write.
        `own`: each request's own width (its drafts, per-request speculation); -1 past it."""
        own = own or [width] * len(requests)
        rows = [
            [self.slot(r, s + j) if j < w else -1 for j in range(width)]
            for r, s, w in zip(requests, starts, own, strict=True)
        ]
        return self.tensor(rows, torch.int64)

    @property
    def scripted(self) -> bool:
        """Whether tests script the drafts on the host alone (`replay` without `device_replay`, `replay_tree`):
        they need the host, so no step is launched ahead."""
        return (self.replay is not None and self.device_replay is None) or self.replay_tree is not None

    def tree_of(self, request: Request) -> list[int]:
        """The parents of the request's drafts: a chain's draft j's is j - 1; a tree's as drafted (the scheduler
        may have cut the drafts short: a prefix)."""
        if self.tree is None:
            return list(range(-1, len(request.draft_ids) - 1))
        return self.parents.get(request.request_id, [])[: len(request.draft_ids)]

    def set_tree(
        self, request: Request, tokens: list[int], parents: list[int] | None, probs: DraftProbs | None = None
    ) -> None:
        """The request's drafts for its next step (a chain's parents are implied, and `probs` its q where they
        were drawn): its own number of drafts, never past the context (a topological prefix of a tree is a tree)."""
        if self.tree is None:
            self.set_drafts(request, tokens, probs)
            return
        assert parents is not None
        if self.replay_tree is not None:
            tokens, parents = self.replay_tree(request, tokens, parents)
        count = min(self.num_drafts(request), max(self.max_model_len - request.num_tokens, 0))
        request.draft_ids = tokens[:count]
        self.parents[request.request_id] = parents[:count]

    def forget(self, request: Request) -> None:
        self.parents.pop(request.request_id, None)

    def num_drafts(self, request: Request) -> int:
        """This request's num_draft_tokens, the drafts it verifies per step: its own (Request.num_draft_tokens,
        at most the drafter's; 0: it never drafts; a chain's first drafts, a tree's first nodes), else the
        drafter's."""
        own = request.num_draft_tokens
        return self.num_draft_tokens if own is None else min(own, self.num_draft_tokens)

    def attention(
        self, requests: list[Request], query_lens: list[int], seq_lens: list[int], slots: list[int], causal: bool
    ) -> AttentionStep:
        block_ids = [r.block_ids for r in requests]
        return build_attention_step(self.backend, block_ids, query_lens, seq_lens, slots, causal, self.device)

    def block_table(self, requests: list[Request]) -> torch.Tensor:
        return block_table_tensor([r.block_ids for r in requests], self.device)

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def context_pass(self, batch: ProposeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionStep]:
        """Features, positions and next-token ids of every row the target computed, and their metadata."""
        rows, positions, next_ids, slots, seq_lens = [], [], [], [], []
        for entry in batch.entries:
            first, count, valid = entry.first_position, entry.num_rows, entry.num_valid
            rows += range(entry.row_start, entry.row_start + count)
            positions += range(first, first + count)
            following = entry.request.token_ids(first + 1, first + valid + 1)  # row p pairs with token p + 1
            next_ids += following + [0] * (count - valid)
            slots += self.slots(entry.request, first, first + count)
            seq_lens.append(first + count)
        requests = [e.request for e in batch.entries]
        step = self.attention(requests, [e.num_rows for e in batch.entries], seq_lens, slots, causal=True)
        features = batch.features[self.tensor(rows, torch.int64)]
        return features, self.tensor(positions, torch.int64), self.tensor(next_ids, torch.int64), step

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> None:
        """Run the drafter and set the drafts of every proposing request in the batch (a tree's with their
        parents)."""
        if not batch.entries:
            return
        if self.tree is not None:
            self._propose_trees(batch)
            return
        proposing = [e.request for e in batch.entries if e.propose]
        sampler = None
        if self.samples_drafts() and DraftSampler.wanted(proposing):
            sampler = DraftSampler(proposing, self.draft_vocab_ids(), self.draft_support)
        drafts = self._draft_chain(batch, sampler, self.penalties_of(proposing))
        probs = sampler.probs_of(len(proposing)) if sampler is not None else [None] * len(proposing)
        for request, ids, q in zip(proposing, _rows(drafts) if proposing else [], probs, strict=True):
            self.set_drafts(request, ids, q)

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The target's id of each id of the drafter's head (EAGLE-3's reduced vocabulary, a constant); None: the
        same ids."""
        return draft_vocab_ids(self.drafter, self.constants)

    def penalties_of(self, requests: list[Request]) -> DraftPenalties | None:
        """The host path's penalised drafting for these proposing requests (None: none of them sets a penalty)."""
        vocab = self.config.model.vocab_size  # the target's
        return DraftPenalties.from_requests(requests, vocab, self.draft_vocab_ids(), self.device)

    @property
    def q_width(self) -> int:
        """Ids a drawn draft's q keeps: `draft_support`, or the drafter's whole head if smaller."""
        return min(self.draft_support, self.config.draft_vocab_size or self.config.model.vocab_size)

    def samples_drafts(self) -> bool:
        """Whether sampled requests draw their drafts from q (`sample_drafts`; auto: the argmax)."""
        return bool(self.sample_drafts)

    def set_drafts(self, request: Request, drafts: list[int], probs: DraftProbs | None = None) -> None:
        """The request's drafts for its next step, never past the context, and the distributions they were
        drawn from (None: greedy, a point mass). Drafts past max_tokens are kept (verified, their tokens
        dropped): the last steps keep num_draft_tokens + 1 tokens per request, so they replay the verify graph
        instead of running eagerly. Scripted drafts (`replay`) are a point mass each."""
        drafts = drafts[: self.num_drafts(request)]  # a request drafting fewer keeps its own
        if self.replay is not None:
            drafts, probs = self.replay(request, drafts), None
        request.draft_ids = drafts[: max(self.max_model_len - request.num_tokens, 0)]
        request.draft_probs = probs.head(len(request.draft_ids)) if probs is not None else None

    def _picker(self, sampler: DraftSampler | StepDraws | None = None, penalties: DraftPenalties | None = None) -> Pick:
        """How a pass picks its drafts from the head's hidden states: the argmax (the drafter's own, as the
        graphs captured it), drawn from q (`sampler`), either under the requests' penalties (`penalties`, which
        count each pick: draft_penalties.py). One picker for the host path and the device step."""
        if sampler is None and penalties is None:
            return self.drafter.draft_tokens
        drafter, choose = self.drafter, argmax if sampler is None else sampler.pick
        if penalties is None:
            return lambda hidden: drafter.to_target(choose(drafter.draft_logits(hidden)))
        return lambda hidden: drafter.to_target(penalties.pick(drafter.draft_logits(hidden), choose))

    def _draft_chain(
        self, batch: ProposeBatch, sampler: DraftSampler | None, penalties: DraftPenalties | None = None
    ) -> torch.Tensor:
        """The proposing requests' chains [B, num_steps] after the context pass over the batch (the method's);
        `sampler` and `penalties` as `_picker`'s (either runs the chain eagerly: the graphs take the argmax)."""
        raise NotImplementedError

    def _propose_trees(self, batch: ProposeBatch) -> None:
        """Per entry, the context pass over its verified rows of the target step (in order), then the trees of
        those that draft now; `batch.reserve(request, positions)` secures the slots the drafter writes."""
        entries, features = batch.entries, batch.features
        if not entries:
            return
        rows, positions, next_ids, slots, seq_lens, query_lens = [], [], [], [], [], []
        for entry in entries:
            request, request_rows = entry.request, entry.verified_rows
            first = request.num_computed_tokens - len(request_rows)
            rows += request_rows
            positions += range(first, first + len(request_rows))
            next_ids += request.token_ids(first + 1, first + len(request_rows) + 1)  # row p pairs with token p + 1
            slots += self.slots(request, first, first + len(request_rows))
            seq_lens.append(first + len(request_rows))
            query_lens.append(len(request_rows))
        requests = [e.request for e in entries]
        step = self.attention(requests, query_lens, seq_lens, slots, causal=True)
        feedback, head = self._tree_context(
            step, self.tensor(positions, torch.int64), self.tensor(next_ids, torch.int64),
            features[self.tensor(rows, torch.int64)],
        )  # fmt: skip
        picked, proposing, offset = [], [], 0
        for entry, count in zip(entries, query_lens, strict=True):
            offset += count
            if not entry.propose:
                continue
            request = entry.request
            ahead = request.num_computed_tokens + self.scratch_width
            if ahead > self.max_model_len or (batch.reserve is not None and not batch.reserve(request, ahead)):
                self.set_tree(request, [], [])  # no room: decode without drafts
                continue
            picked.append(offset - 1)  # the newest verified row
            proposing.append(request)
        if proposing:
            index = self.tensor(picked, torch.int64)
            trees = self.draft(proposing, head[index], feedback[index], self.penalties_of(proposing))
            for request, (tokens, parents) in zip(proposing, trees, strict=True):
                self.set_tree(request, tokens, parents)

    def _tree_context(
        self, step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`context_pass_rows` on the host path: a lone request's rows through the context pass's prefill graphs,
        others eagerly."""
        forward, kind = self._prefill_replay(step, positions.shape[0])
        self.pass_counts[f"tree_context {kind}"] += 1
        return self.context_pass_rows(step, positions, next_ids, features, forward)

    def _prefill_replay(self, step: AttentionStep, num_rows: int) -> tuple[PassForward | None, str]:
        """The context pass over `num_rows` rows as a replay of a prefill graph: a lone request's bucket, else
        several requests' (the batch graphs), its outputs cut to the real rows (a context pass's outputs are per
        row); and which it is ("prefill graph", "batch prefill graph"; None, "eager": no bucket fits)."""
        lone, batch = self.prefill_graphs, self.batch_prefill_graphs
        rows = lone.bucket(step, num_rows) if lone is not None else None
        if lone is not None and rows is not None:

            def replayed(step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
                return tuple(output[:num_rows] for output in lone.run(rows, positions, step, **x))

            return replayed, "prefill graph"
        rows = batch.bucket(step, num_rows) if batch is not None else None
        if batch is not None and rows is not None:
            graphs = batch.graphs[rows]

            def batched(step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
                return tuple(output[:num_rows] for output in graphs.run_rows(step, positions, **x))

            return batched, "batch prefill graph"
        return None, "eager"

    def draft(
        self, requests: list[Request], head: torch.Tensor, hidden: torch.Tensor, penalties: DraftPenalties | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """The trees (tokens, parents) of `requests` from the newest verified row's head and feedback [B, H]."""
        last = self.tensor([r.num_computed_tokens - 1 for r in requests], torch.int64)
        starts = [r.num_computed_tokens for r in requests]
        scratch = self.slots_ahead(requests, starts, self.scratch_width)  # [B, scratch_width]
        tokens, parents = self.draft_tree(self.block_table(requests), last, scratch, head, hidden, penalties)
        flat, size = to_host(torch.cat([tokens, parents], dim=1).reshape(-1)), tokens.shape[1]
        return [(flat[i : i + size], flat[i + size : i + 2 * size]) for i in range(0, len(flat), 2 * size)]

    def context_pass_rows(
        self, step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor,
        forward: PassForward | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The drafter over verified target rows (`features`, each paired with the token after it): its
        feedback and head per row, which `draft_tree` reads at the newest verified row. `forward`: what runs the
        context pass over its inputs (CONTEXT_PASS's; None: its eager forward)."""
        raise NotImplementedError

    def draft_tree(
        self, block_table: torch.Tensor, last: torch.Tensor, scratch: torch.Tensor, head: torch.Tensor,
        hidden: torch.Tensor, penalties: DraftPenalties | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The trees on the device, no host sync (the device-resident tree step captures it): tokens and parents
        [B, drafts] (-1: the root) from the newest verified row's head and feedback [B, H] at positions `last`;
        `scratch` [B, num_inputs] the slots of positions last + 1, ... that the drafter's passes write;
        `penalties`: candidates ranked under each request's history (draft_penalties.py; the method's)."""
        raise NotImplementedError

    def propose_verified(
        self,
        step: AttentionStep,
        positions: torch.Tensor,
        features: torch.Tensor,
        verdict: Verdict,
        slots_ahead: torch.Tensor,
        draws: StepDraws | None = None,
        penalties: DraftPenalties | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The next drafts after a verify step on the device, without the host: a chain's [B, num_steps] (parents None),
        or a tree's tokens and parents [B, N]: the context pass over the root and the path rows at root, root + 1,
        ... (row i pairs with emitted token i), then the tree drafted from the newest verified row. `step` and
        `positions` are the verify pass's (consecutive slots and positions from each root); `slots_ahead`
        [B, ahead_width] the slots of positions root, root + 1, ...; `draws`: a chain's sampled requests draw
        their drafts from q (None: the argmax; a tree's drafts always are); `penalties`: the step's penalised
        requests pick under their penalties (draft_penalties.py)."""
        constants, tree = self.constants, self.tree
        if tree is None:
            chain = self._propose_verified_chain(step, positions, features, verdict, slots_ahead, draws, penalties)
            return chain, None
        assert draws is None, "a tree's drafts are the drafter's top ids, never drawn"
        count, rows, width = slots_ahead.shape[0], self.num_draft_tokens + 1, self.num_steps + 1
        root = positions.view(count, rows)[:, 0]
        path_slots = step.slot_mapping.view(count, rows)[:, :width].reshape(-1)  # root + depth: the path's slots
        context = AttentionStep(
            backend=self.backend, block_table=step.block_table, query_start_loc=constants.starts(count, width),
            seq_lens=step.seq_lens - (rows - width), slot_mapping=path_slots, max_query_len=width,
            max_seq_len=self.max_model_len,
        )  # fmt: skip
        path_rows = (constants.strided(count, rows)[:, None] + verdict.path_rows).reshape(-1)
        context_positions = (root[:, None] + constants.arange(width)).reshape(-1)
        feedback, head = self.context_pass_rows(
            context, context_positions, verdict.emitted.reshape(-1), features[path_rows]
        )
        picked = constants.strided(count, width) + verdict.accepted  # the newest verified row
        past_root = constants.get(
            ("scratch offsets", self.scratch_width), lambda: constants.arange(self.scratch_width) + 1
        )
        scratch = slots_ahead.gather(1, verdict.accepted[:, None] + past_root[None, :])  # past the newest
        last = root + verdict.accepted
        return self.draft_tree(step.block_table, last, scratch, head[picked], feedback[picked], penalties)

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
        """A chain's drafts [B, num_steps] after a verify step on the device (the method's); `draws`: drawn from q;
        `penalties`: picked under them."""
        raise NotImplementedError

    def _offsets(self, width: int) -> torch.Tensor:
        return torch.arange(width, device=self.device)[None, :]

    def _run(
        self, name: str, uniform: bool, step: AttentionStep, positions: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """A pass over host-built metadata; replayed when the batch is uniform and fits a graph. A batch of one
        row per request (steps without drafts: adaptive speculation's k = 0) replays the pass's one-row graphs;
        a lone request's rows (a prompt, held rows flushed) the context pass's prefill graphs."""
        if not uniform and step.max_query_len == 1 and f"{name} row" in self.graphs:
            name, uniform = f"{name} row", True
        graphs = self.graphs.get(name)
        if graphs is not None and uniform and step.seq_lens.shape[0] <= graphs.max_batch:
            self.pass_counts[f"{name} graph"] += 1
            return graphs.run(step.block_table, step.seq_lens, step.slot_mapping, positions, **inputs)
        forward, kind = self._prefill_replay(step, positions.shape[0]) if name == self.CONTEXT_PASS else (None, "")
        if forward is not None:
            self.pass_counts[f"{name} {kind}"] += 1
            return forward(step, positions, inputs)
        self.pass_counts[f"{name} eager"] += 1
        return self.passes[name].forward(step, positions, inputs)

    def _run_device_metadata(
        self, name: str, block_table: torch.Tensor, positions: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """A pass that builds its own metadata on the device (chain, block): one position per request."""
        graphs = self.graphs.get(name)
        if graphs is not None and block_table.shape[0] <= graphs.max_batch:
            self.pass_counts[f"{name} graph"] += 1
            return graphs.replay(block_table, positions, **inputs)
        self.pass_counts[f"{name} eager"] += 1
        return self._metadata_forward(name)(block_table, positions, inputs)

    def _metadata_forward(self, name: str) -> OwnMetadataForward:
        """The eager forward of a pass that builds its own metadata (the method's)."""
        raise NotImplementedError

    def _passes(self) -> dict[str, DraftPass]:
        """Each pass a graph can replay, by name (the method's)."""
        raise NotImplementedError

    def capture_graphs(self, max_batch: int, row_batch: int | None = None) -> None:
        """One graph set per pass (CUDA, capture-safe drafter backend), up to `max_batch` requests, the one-row
        context passes up to `row_batch` (a decode step's whole batch: at k = 0 the drafter's pass is all it adds
        to the target's); larger batches, and context passes of uneven batches, run eagerly."""
        for name, draft_pass in self.passes.items():
            batch = (row_batch or max_batch) if name.endswith(" row") else max_batch
            graphs = StepGraphs(
                f"drafter {name}", draft_pass.forward, self.backend, draft_pass.query_len, batch,
                self.max_model_len, self.block_size, self.device, draft_pass.inputs,
                request_inputs=draft_pass.request_inputs,
            )  # fmt: skip
            graphs.capture()
            self.graphs[name] = graphs

    def capture_prefill_graphs(self, max_rows: int) -> None:
        """Graphs for a lone request's context pass of up to `max_rows` rows (runner/prefill_graphs.py): after
        its prompt's prefill (or chunk), and when its held rows are flushed (deferred_context.py)."""
        draft_pass = self.passes[self.CONTEXT_PASS]
        graphs = PrefillGraphs(
            f"drafter {self.CONTEXT_PASS}", draft_pass.forward, self.backend, prefill_buckets(max_rows),
            self.max_model_len, self.block_size, self.device, draft_pass.inputs,
        )  # fmt: skip
        graphs.capture()
        self.prefill_graphs = graphs

    def capture_batch_prefill_graphs(self, max_rows: int, max_requests: int) -> None:
        """Graphs for the context pass over several requests' rows, up to `max_rows` rows and `max_requests`
        requests (runner/prefill_graphs.py): prompts prefilled together, held rows flushed at once. Into the lone
        graphs' pool (capture_prefill_graphs first): one context pass runs at a time."""
        draft_pass = self.passes[self.CONTEXT_PASS]
        graphs = BatchPrefillGraphs(
            f"drafter {self.CONTEXT_PASS} batch", draft_pass.forward, self.backend, prefill_buckets(max_rows),
            max_requests, self.max_model_len, self.block_size, self.device, draft_pass.inputs,
        )  # fmt: skip
        graphs.capture(self.prefill_graphs.pool if self.prefill_graphs is not None else None)
        self.batch_prefill_graphs = graphs


def _reads_block_table(forward: OwnMetadataForward) -> PassForward:
    """A graph's forward for a pass that needs only the block table of the step the graph hands it."""
    return lambda step, positions, inputs: forward(step.block_table, positions, inputs)


def _rows(tokens: torch.Tensor) -> list[list[int]]:
    flat = to_host(tokens.reshape(-1))
    width = tokens.shape[-1]
    return [flat[i : i + width] for i in range(0, len(flat), width)]
