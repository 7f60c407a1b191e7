"""Proposers: after each target step, the drafter turns the target's features into the next drafts.

The drafter has its own paged cache (its own layers, the target's block ids). Each proposal first runs
the drafter over every row the target just computed (the "context pass": EAGLE's first step, DFlash's
context K/V). Rows the verification rejected are run too, so that steps have a fixed shape for CUDA
graphs; their cache entries lie past the verified tokens and are overwritten before anything reads
them. Then:

- EAGLE / EAGLE-3: k - 1 more chain steps, one token per request. Each step's attention metadata
  (positions, seq_lens, slot_mapping) is rebuilt before it runs (R10), on the device, from the newest
  verified position and the slots ahead of it, so the whole chain replays as one CUDA graph.
- DFlash: one pass over the block [last token, MASK x (B-1)], non-causal unless configured causal (R9),
  its metadata built on the device the same way.

Two entry points share these passes: `propose` (the host knows which rows were verified: after a prefill
chunk, a sampled request, an uneven batch) and `propose_verified` (greedy verification computed on the
device, inside the speculative step's graph: see spec_step.py). `propose` drafts the argmax for greedy
requests and draws from the drafter's distribution for sampled ones (draft_sampling.py), eagerly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from executor_service.attention_step import (
    AttentionStep,
    block_table_tensor,
    build_attention_step,
    cache_slot,
    to_device,
)
from executor_service.cuda_graphs import RequestInputs, StepGraphs, TokenInputs
from executor_service.draft_models import DFlashDrafter, Drafter, Eagle3Drafter
from executor_service.draft_sampling import DRAFT_SUPPORT, DraftSampler
from executor_service.kv_cache import KVCache
from executor_service.request import Request
from executor_service.sampling import DraftProbs, to_host
from executor_service.verifier import Verdict
from selection.draft_tree import TreeShape

Replay = Callable[[Request, list[int]], list[int]]  # test drafters: rewrite a request's drafts
PassForward = Callable[[AttentionStep, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
# (block table, one position per request, inputs) -> outputs: a pass that builds its metadata on the device
OwnMetadataForward = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
Pick = Callable[[torch.Tensor], torch.Tensor]  # the head's hidden states [B, (n,) H] -> draft ids [B, (n)] (target)


@dataclass(frozen=True)
class ProposeEntry:
    """One request that ran in the target step just verified and is still running."""

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
    def __init__(
        self, drafter: Drafter, kv_cache: KVCache, backend: str, max_model_len: int, device: torch.device
    ) -> None:
        self.drafter, self.kv_cache, self.backend = drafter, kv_cache, backend
        self.config = drafter.config
        self.k = self.config.num_speculative_tokens
        self.dflash = isinstance(drafter, DFlashDrafter)
        self.block_size = kv_cache.block_size
        self.max_model_len, self.device = max_model_len, device
        self.tree: TreeShape | None = None  # a chain (tree_proposer.py: trees)
        self.replay: Replay | None = None
        # Sampled requests' drafts: True drawn from q (draft_sampling.py: verified on the host path, the chain run
        # eagerly), False or None (auto) the argmax, verified as point masses on the device step (verifier.py)
        # with or without CUDA graphs. docs/executor.md has both timed at T = 0.7.
        self.sample_drafts: bool | None = None
        self.draft_support = DRAFT_SUPPORT  # ids each drawn draft's q keeps (draft_sampling.py)
        self.pass_counts: Counter[str] = Counter()  # "<pass> graph" / "<pass> eager" (benchmarks read it)
        self.graphs: dict[str, StepGraphs] = {}  # by pass name; see capture_graphs
        self.passes = self._passes()

    @property
    def ahead_width(self) -> int:
        """Slots of the positions a device step's proposal may write, from the root (the first verify row) on:
        the k + 1 verify rows and the drafter's lookahead (see propose_verified)."""
        return self.k + 1 + self.config.positions_ahead

    # ---- metadata from host lists -----------------------------------------------------------
    def slot(self, request: Request, position: int) -> int:
        """Cache slot of `position`, -1 past the context or the request's blocks (written nowhere)."""
        if position >= self.max_model_len:
            return -1
        return cache_slot(request.block_ids, position, self.block_size)

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
        """Whether tests script the drafts (`replay`): they need the host, so no step is launched ahead."""
        return self.replay is not None

    def tree_of(self, request: Request) -> list[int]:
        """The parents of the request's drafts: a chain's, draft j's is j - 1 (trees: tree_proposer.py)."""
        return list(range(-1, len(request.draft_ids) - 1))

    def set_tree(self, request: Request, tokens: list[int], parents: list[int] | None) -> None:
        """The drafts a device step proposed (a chain's parents are implied)."""
        self.set_drafts(request, tokens)

    def forget(self, request: Request) -> None:
        """A finished request: nothing kept per request here (a tree proposer keeps its parents)."""

    def num_drafts(self, request: Request) -> int:
        """Drafts per step for this request: its own number (GenerateRequest.num_speculative_tokens, at most
        k; 0: it never drafts), else the loaded drafter's k."""
        own = request.num_speculative_tokens
        return self.k if own is None else min(own, self.k)

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
            slots += [self.slot(entry.request, p) for p in range(first, first + count)]
            seq_lens.append(first + count)
        requests = [e.request for e in batch.entries]
        step = self.attention(requests, [e.num_rows for e in batch.entries], seq_lens, slots, causal=True)
        features = batch.features[self.tensor(rows, torch.int64)]
        return features, self.tensor(positions, torch.int64), self.tensor(next_ids, torch.int64), step

    # ---- metadata advanced on the device (R10: rebuilt for every pass, no host list) ----------
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

    # ---- proposing from host bookkeeping ----------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> None:
        """Run the drafter and set `draft_ids` of every proposing request in the batch: greedy drafts, or, when
        a sampled request proposes, drafts drawn from the drafter's distribution for it (draft_sampling.py)."""
        if not batch.entries:
            return
        proposing = [e.request for e in batch.entries if e.propose]
        sampler = None
        if self.samples_drafts() and DraftSampler.wanted(proposing):
            vocab_ids = self.drafter.target_ids() if isinstance(self.drafter, Eagle3Drafter) else None
            sampler = DraftSampler(proposing, vocab_ids, self.draft_support)
        drafts = self._propose_dflash(batch, sampler) if self.dflash else self._propose_eagle(batch, sampler)
        probs = sampler.probs_of(len(proposing)) if sampler is not None else [None] * len(proposing)
        for request, ids, q in zip(proposing, _rows(drafts) if proposing else [], probs, strict=True):
            self.set_drafts(request, ids, q)

    def samples_drafts(self) -> bool:
        """Whether sampled requests draw their drafts from q (`sample_drafts`; auto: the argmax)."""
        return bool(self.sample_drafts)

    def set_drafts(self, request: Request, drafts: list[int], probs: DraftProbs | None = None) -> None:
        """The request's drafts for its next step, never past the context, and the distributions they were
        drawn from (None: greedy, a point mass). Drafts past max_tokens are kept (verified, their tokens
        dropped): the last steps keep k + 1 tokens per request, so they replay the verify graph instead of
        running eagerly. Scripted drafts (`replay`) are a point mass each."""
        drafts = drafts[: self.num_drafts(request)]  # a request drafting fewer than k keeps its own
        if self.replay is not None:
            drafts, probs = self.replay(request, drafts), None
        request.draft_ids = drafts[: max(self.max_model_len - request.num_tokens, 0)]
        request.draft_probs = probs.head(len(request.draft_ids)) if probs is not None else None

    def _picker(self, sampler: DraftSampler) -> Pick:
        return lambda hidden: self.drafter.to_target(sampler.pick(self.drafter.draft_logits(hidden)))

    def _propose_eagle(self, batch: ProposeBatch, sampler: DraftSampler | None = None) -> torch.Tensor:
        features, positions, next_ids, step = self.context_pass(batch)
        uniform = all(e.propose and e.num_rows == self.k + 1 for e in batch.entries)
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
        pick = self._picker(sampler) if sampler is not None else self.drafter.draft_tokens
        tokens, hidden = pick(head[picked]), feedback[picked]
        last = [r.num_computed_tokens - 1 for r in proposing]  # position of each request's newest verified row
        own = [self.num_drafts(r) for r in proposing]  # the chain runs k - 1 steps; each keeps its own drafts
        ahead = self.slots_ahead(proposing, last, self.k, own)
        chain_inputs = {"input_ids": tokens, "hidden": hidden, "ahead_slots": ahead}
        block_table, positions = self.block_table(proposing), self.tensor(last, torch.int64)
        if sampler is not None:  # each pick's noise keyed from the host (draft_sampling.py): eager
            self.pass_counts["eagle_chain sampled"] += 1
            (rest,) = self._eagle_chain(block_table, positions, chain_inputs, pick)
        else:
            (rest,) = self._run_device_metadata("eagle_chain", block_table, positions, chain_inputs)
        return torch.cat([tokens[:, None], rest], dim=1)

    def _propose_dflash(self, batch: ProposeBatch, sampler: DraftSampler | None = None) -> torch.Tensor:
        features, positions, _, step = self.context_pass(batch)
        uniform = all(e.propose and e.num_rows == self.k + 1 for e in batch.entries)
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
        if sampler is not None:
            self.pass_counts["dflash_block sampled"] += 1
            return self._dflash_block(block_table, positions, inputs, self._picker(sampler))[0]
        (tokens,) = self._run_device_metadata("dflash_block", block_table, positions, inputs)
        return tokens

    # ---- proposing from a verification done on the device -----------------------------------
    def propose_verified(
        self,
        step: AttentionStep,
        positions: torch.Tensor,
        features: torch.Tensor,
        verdict: Verdict,
        slots_ahead: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [B, k] after a verify step on the device, without the host (parents None: a chain's): `step`
        and `positions` are the verify pass's (B requests x k + 1 rows), `verdict.emitted` [B, k + 1] the
        target's tokens (row i's is the token after it, wherever the drafts were accepted), `verdict.accepted` [B]
        the accepted drafts and `slots_ahead` [B, ahead_width] the slots of positions root, root + 1, ..."""
        target_ids, accepted = verdict.emitted, verdict.accepted
        count, rows = target_ids.shape
        context_step = replace(step, backend=self.backend, _flex=None)  # the verify rows, the drafter's kernels
        first = positions.view(count, rows)[:, 0]
        if self.dflash:
            self._dflash_context(context_step, positions, {"features": features})
            newest = target_ids.gather(1, accepted[:, None])[:, 0]  # the bonus token opens the block
            starts = first + accepted + 1
            ahead = slots_ahead.gather(1, (accepted + 1)[:, None] + self._offsets(self.config.block_size))
            return self._dflash_block(step.block_table, starts, {"input_ids": newest, "ahead_slots": ahead})[0], None
        context = {"input_ids": target_ids.reshape(-1), "features": features}
        feedback, head = self._eagle_context(context_step, positions, context)
        picked = torch.arange(count, device=accepted.device) * rows + accepted  # the newest verified row
        tokens, hidden = self.drafter.draft_tokens(head[picked]), feedback[picked]
        ahead = slots_ahead.gather(1, accepted[:, None] + self._offsets(self.k))
        chain = {"input_ids": tokens, "hidden": hidden, "ahead_slots": ahead}
        (rest,) = self._eagle_chain(step.block_table, first + accepted, chain)
        return torch.cat([tokens[:, None], rest], dim=1), None

    def _offsets(self, width: int) -> torch.Tensor:
        return torch.arange(width, device=self.device)[None, :]

    # ---- the drafter's passes: eager, or replayed from a graph ---------------------------------
    def _run(
        self, name: str, uniform: bool, step: AttentionStep, positions: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """A pass over host-built metadata; replayed when the batch is uniform and fits a graph."""
        graphs = self.graphs.get(name)
        if graphs is not None and uniform and step.seq_lens.shape[0] <= graphs.max_batch:
            self.pass_counts[f"{name} graph"] += 1
            return graphs.run(step.block_table, step.seq_lens, step.slot_mapping, positions, **inputs)
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
        forward = {"eagle_chain": self._eagle_chain, "dflash_block": self._dflash_block}[name]
        return forward(block_table, positions, inputs)

    def _passes(self) -> dict[str, DraftPass]:
        """Each pass a graph can replay, by name."""
        hidden = self.config.model.hidden_size
        features = len(self.config.target_layer_ids) * hidden or hidden
        dtype, ids = self.kv_cache.storage.dtype, ((), torch.int64)
        if self.dflash:
            size = self.config.block_size
            return {
                "dflash_context": DraftPass(self._dflash_context, self.k + 1, {"features": ((features,), dtype)}),
                "dflash_block": DraftPass(
                    _reads_block_table(self._dflash_block), 1, {"input_ids": ids},
                    {"ahead_slots": ((size,), torch.int64, -1)},
                ),
            }  # fmt: skip
        context_inputs = {"input_ids": ids, "features": ((features,), dtype)}
        return {
            "eagle_context": DraftPass(self._eagle_context, self.k + 1, context_inputs),
            "eagle_chain": DraftPass(
                _reads_block_table(self._eagle_chain),
                1,
                {"input_ids": ids, "hidden": ((hidden,), dtype)},
                {"ahead_slots": ((self.k,), torch.int64, -1)},
            ),
        }

    def _eagle_context(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        hidden = self.drafter.combine(x["features"])
        return self.drafter(x["input_ids"], positions, hidden, self.kv_cache.layers, step)

    def _eagle_chain(
        self, block_table: torch.Tensor, positions: torch.Tensor, x: dict[str, torch.Tensor], pick: Pick | None = None
    ) -> tuple:
        """Drafts 2..k [B, k - 1] from draft 1 (`input_ids`, `hidden`) at the newest verified `positions`;
        `ahead_slots` [B, k]: slots of positions + 0..k-1. `pick`: how a step's drafts are chosen (the argmax)."""
        pick = pick or self.drafter.draft_tokens
        tokens, hidden, drafted = x["input_ids"], x["hidden"], []
        # Every chain step's metadata at once, one row per step (a few kernels instead of a few per step).
        steps = torch.arange(1, self.k, device=positions.device)[:, None]
        # A request whose slots end early (fewer drafts of its own, the context's end) repeats its last
        # writable position, written nowhere (slot -1): no step reads past its blocks. -1 only at the tail.
        writable = (x["ahead_slots"] >= 0).sum(dim=1)
        steps = torch.minimum(steps, (writable - 1).clamp(min=0)[None, :])
        chain_positions = (positions[None, :] + steps).clamp(max=self.max_model_len - 1)  # [k - 1, B]
        chain_seq_lens = (chain_positions + 1).to(torch.int32)
        chain_slots = x["ahead_slots"][:, 1:].t().contiguous()
        query_start_loc = torch.arange(positions.shape[0] + 1, dtype=torch.int32, device=positions.device)
        for j in range(self.k - 1):
            step = self.chain_step(block_table, query_start_loc, chain_positions[j], chain_seq_lens[j], chain_slots[j])
            hidden, head = self.drafter(tokens, chain_positions[j], hidden, self.kv_cache.layers, step)
            tokens = pick(head)
            drafted.append(tokens)
        if not drafted:
            return (torch.empty(tokens.shape[0], 0, dtype=torch.int64, device=tokens.device),)
        return (torch.stack(drafted, dim=1),)

    def _dflash_context(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        self.drafter.store_context(x["features"], positions, step.slot_mapping, self.kv_cache.layers)
        return ()

    def _dflash_block(
        self, block_table: torch.Tensor, starts: torch.Tensor, x: dict[str, torch.Tensor], pick: Pick | None = None
    ) -> tuple:
        """Drafts [B, k] from the block opened by `input_ids` at `starts`; `ahead_slots` [B, block]. `pick`: how
        the drafts of all positions are chosen at once (the argmax)."""
        hidden = self.dflash_block_hidden(block_table, starts, x)[:, 1 : self.k + 1]  # slot i: token i
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

    def capture_graphs(self, max_batch: int) -> None:
        """One graph set per pass (CUDA, capture-safe drafter backend); larger batches, and context passes
        of uneven batches, run eagerly."""
        for name, draft_pass in self.passes.items():
            graphs = StepGraphs(
                f"drafter {name}", draft_pass.forward, self.backend, draft_pass.query_len, max_batch,
                self.max_model_len, self.block_size, self.device, draft_pass.inputs,
                request_inputs=draft_pass.request_inputs,
            )  # fmt: skip
            graphs.capture()
            self.graphs[name] = graphs


def _reads_block_table(forward: OwnMetadataForward) -> PassForward:
    """A graph's forward for a pass that needs only the block table of the step the graph hands it."""
    return lambda step, positions, inputs: forward(step.block_table, positions, inputs)


def _rows(tokens: torch.Tensor) -> list[list[int]]:
    flat = to_host(tokens.reshape(-1))
    width = tokens.shape[-1]
    return [flat[i : i + width] for i in range(0, len(flat), width)]
