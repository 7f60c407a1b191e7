"""Proposers: after each target step, the drafter turns the target's features into the next drafts.

The drafter has its own paged cache (its own layers, the target's block ids). Each proposal first runs
the drafter over every row the target just computed (the "context pass": EAGLE's first step, DFlash's
context K/V). Rows the verification rejected are run too, so that steps have a fixed shape for CUDA
graphs; their cache entries lie past the verified tokens and are overwritten before anything reads
them. Then:

- EAGLE / EAGLE-3: k - 1 more chain steps, one token per request, each with its attention metadata
  (positions, seq_lens, slot_mapping) rebuilt before it runs (R10).
- DFlash: one pass over the block [last token, MASK x (B-1)], non-causal unless configured causal (R9).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor_service.attention_step import AttentionStep, build_attention_step, cache_slot
from executor_service.cuda_graphs import GraphForward, StepGraphs
from executor_service.draft_models import DFlashDrafter, Drafter
from executor_service.kv_cache import KVCache
from executor_service.request import Request
from executor_service.sampling import to_host

Replay = Callable[[Request, list[int]], list[int]]  # test drafters: rewrite a request's drafts


@dataclass(frozen=True)
class ProposeEntry:
    """One request that ran in the target step just verified and is still running."""

    request: Request
    row_start: int  # its first row among the target step's rows (into the features)
    num_rows: int  # rows the target computed for it
    num_valid: int  # of which verified (prefill chunk: all; verify: accepted drafts + 1)
    propose: bool  # has a new last token: draft for the next step (not a prefill chunk mid-prompt)

    @property
    def first_position(self) -> int:
        return self.request.num_computed_tokens - self.num_valid


@dataclass
class ProposeBatch:
    entries: list[ProposeEntry]
    features: torch.Tensor  # [T, F] what the drafter reads of every target row


class Proposer:
    def __init__(
        self, drafter: Drafter, kv_cache: KVCache, backend: str, max_model_len: int, device: torch.device
    ) -> None:
        self.drafter, self.kv_cache, self.backend = drafter, kv_cache, backend
        self.config = drafter.config
        self.k = self.config.num_speculative_tokens
        self.block_size = kv_cache.block_size
        self.max_model_len, self.device = max_model_len, device
        self.replay: Replay | None = None
        self.pass_counts: Counter[str] = Counter()  # "<pass> graph" / "<pass> eager" (benchmarks read it)
        self.graphs: dict[str, StepGraphs] = {}  # by pass name; see capture_graphs
        self.passes = self._passes()

    # ---- metadata from host lists -----------------------------------------------------------
    def slot(self, request: Request, position: int) -> int:
        """Cache slot of `position`, -1 past the context or the request's blocks (written nowhere)."""
        if position >= self.max_model_len:
            return -1
        return cache_slot(request.block_ids, position, self.block_size)

    def attention(
        self, requests: list[Request], query_lens: list[int], seq_lens: list[int], slots: list[int], causal: bool
    ) -> AttentionStep:
        block_ids = [r.block_ids for r in requests]
        return build_attention_step(self.backend, block_ids, query_lens, seq_lens, slots, causal, self.device)

    def tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

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

    # ---- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> None:
        """Run the drafter and set `draft_ids` of every proposing request in the batch."""
        if not batch.entries:
            return
        dflash = isinstance(self.drafter, DFlashDrafter)
        drafts = self._propose_dflash(batch) if dflash else self._propose_eagle(batch)
        proposing = [e.request for e in batch.entries if e.propose]
        for request, ids in zip(proposing, drafts, strict=True):
            request.draft_ids = self.replay(request, ids) if self.replay is not None else ids

    def _propose_eagle(self, batch: ProposeBatch) -> list[list[int]]:
        features, positions, next_ids, step = self.context_pass(batch)
        uniform = all(e.propose and e.num_rows == self.k + 1 for e in batch.entries)
        feedback, head = self._run(
            "eagle_context", uniform, step, positions, input_ids=next_ids, features=features
        )  # fmt: skip
        sample_rows, proposing, offset = [], [], 0
        for entry in batch.entries:
            if entry.propose:
                sample_rows.append(offset + entry.num_valid - 1)  # the newest verified row
                proposing.append(entry.request)
            offset += entry.num_rows
        if not proposing:
            return []
        picked = self.tensor(sample_rows, torch.int64)
        tokens, hidden = self.drafter.draft_tokens(head[picked]), feedback[picked]
        drafted = [tokens]
        last = [r.num_computed_tokens - 1 for r in proposing]  # position of each request's newest verified row
        for j in range(1, self.k):
            # R10: positions, seq_lens and slots of this chain step, rebuilt before it runs (graphs too:
            # StepGraphs.run copies them into its static buffers before the replay).
            step_positions = [min(p + j, self.max_model_len - 1) for p in last]
            step_slots = [self.slot(r, p + j) for r, p in zip(proposing, last, strict=True)]
            step_seq_lens = [p + 1 for p in step_positions]
            step = self.attention(proposing, [1] * len(proposing), step_seq_lens, step_slots, causal=True)
            positions = self.tensor(step_positions, torch.int64)
            tokens, hidden = self._run("eagle_chain", True, step, positions, input_ids=tokens, hidden=hidden)
            drafted.append(tokens.clone())  # a graph's output buffer is overwritten by its next replay
        return _rows(torch.stack(drafted, dim=1))

    def _propose_dflash(self, batch: ProposeBatch) -> list[list[int]]:
        config = self.config
        features, positions, _, step = self.context_pass(batch)
        uniform = all(e.propose and e.num_rows == self.k + 1 for e in batch.entries)
        self._run("dflash_context", uniform, step, positions, features=features)
        proposing = [e.request for e in batch.entries if e.propose]
        if not proposing:
            return []
        size = config.block_size
        block_ids, block_positions, block_slots, seq_lens = [], [], [], []
        for request in proposing:
            first = request.num_tokens - 1  # the newest token opens the block
            newest = request.token_ids(first, first + 1)  # sampled, or the last prompt token after a chunk
            block_ids += newest + [config.mask_token_id] * (size - 1)
            block_positions += [min(first + j, self.max_model_len - 1) for j in range(size)]
            block_slots += [self.slot(request, first + j) for j in range(size)]
            seq_lens.append(min(first + size, self.max_model_len))
        step = self.attention(proposing, [size] * len(proposing), seq_lens, block_slots, causal=config.causal)
        positions = self.tensor(block_positions, torch.int64)
        (tokens,) = self._run("dflash_block", True, step, positions, input_ids=self.tensor(block_ids, torch.int64))
        return _rows(tokens)

    # ---- the drafter's passes: eager, or replayed from a graph when the batch is uniform --------
    def _run(
        self, name: str, uniform: bool, step: AttentionStep, positions: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        graphs = self.graphs.get(name)
        if graphs is not None and uniform and step.seq_lens.shape[0] <= graphs.max_batch:
            self.pass_counts[f"{name} graph"] += 1
            return graphs.run(step.block_table, step.seq_lens, step.slot_mapping, positions, **inputs)
        self.pass_counts[f"{name} eager"] += 1
        return self.passes[name][0](step, positions, inputs)

    def _passes(self) -> dict[str, tuple[GraphForward, int, dict[str, tuple[tuple[int, ...], torch.dtype]]]]:
        """name -> (forward, query tokens per request, per-token inputs) of each pass a graph can replay."""
        hidden = self.config.model.hidden_size
        features = len(self.config.target_layer_ids) * hidden or hidden
        dtype, ids = self.kv_cache.storage.dtype, ((), torch.int64)
        if isinstance(self.drafter, DFlashDrafter):
            return {
                "dflash_context": (self._dflash_context, self.k + 1, {"features": ((features,), dtype)}),
                "dflash_block": (self._dflash_block, self.config.block_size, {"input_ids": ids}),
            }
        return {
            "eagle_context": (self._eagle_context, self.k + 1, {"input_ids": ids, "features": ((features,), dtype)}),
            "eagle_chain": (self._eagle_chain, 1, {"input_ids": ids, "hidden": ((hidden,), dtype)}),
        }

    def _eagle_context(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        hidden = self.drafter.combine(x["features"])
        return self.drafter(x["input_ids"], positions, hidden, self.kv_cache.layers, step)

    def _eagle_chain(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        feedback, head = self.drafter(x["input_ids"], positions, x["hidden"], self.kv_cache.layers, step)
        return self.drafter.draft_tokens(head), feedback

    def _dflash_context(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        self.drafter.store_context(x["features"], positions, step.slot_mapping, self.kv_cache.layers)
        return ()

    def _dflash_block(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        hidden = self.drafter(x["input_ids"], positions, self.kv_cache.layers, step)
        hidden = hidden.view(-1, self.config.block_size, hidden.shape[-1])[:, 1 : self.k + 1]  # slot i: token i
        return (self.drafter.draft_tokens(hidden),)

    def capture_graphs(self, max_batch: int) -> None:
        """One graph set per pass (CUDA, capture-safe drafter backend); batches that are not uniform and
        larger ones run eagerly."""
        for name, (forward, query_len, inputs) in self.passes.items():
            causal = not (name == "dflash_block" and not self.config.causal)
            graphs = StepGraphs(
                f"drafter {name}", forward, self.backend, query_len, max_batch, self.max_model_len,
                self.block_size, self.device, inputs, causal,
            )  # fmt: skip
            graphs.capture()
            self.graphs[name] = graphs


def _rows(tokens: torch.Tensor) -> list[list[int]]:
    flat = to_host(tokens.reshape(-1))
    width = tokens.shape[-1]
    return [flat[i : i + width] for i in range(0, len(flat), width)]
