"""The proposer's drafts equal a from-scratch recompute: every proposal the engine makes, for every drafter,
is checked against the drafter run densely over the request's whole history on a fresh cache. Stale
attention metadata or positions in EAGLE's chain steps 2..k (R10), or in DFlash's context and block, change
the drafts; the tests below the reference show that the comparison catches such staleness.

The reference for a request with tokens t_0..t_{N-1}: target features f_0..f_{N-2} from one pass of the
target over t_0..t_{N-2} (EAGLE-1: the final normed hidden state; EAGLE-3 and DFlash: the residual stream
after each of the drafter's target layers, concatenated).
- EAGLE: rows p = 0..N-2 pair t_{p+1} with f_p at position p; chain step j adds the row (draft j, the
  drafter's own output hidden state of the row before) at position N-2+j. Draft j is the head of the
  newest row; every row is recomputed from scratch, causally, for each draft.
- DFlash: context f_0..f_{N-2} at positions 0..N-2, then the block [t_{N-1}, MASK x (B-1)] at positions
  N-1..N+B-2 (non-causal unless configured causal); drafts are the target's LM head on block rows 1..k.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from spec_builders import spec_session
from spec_metadata_runs import (
    BATCHED_TOKENS,
    LENGTHS,
    MAX_TOKENS,
    WRONG_AT,
    K,
    Proposal,
    prompts,
    run_recorded,
)

from executor_service.engine.kv_cache import KVCache, blocks_needed
from executor_service.models.attention_step import AttentionStep
from executor_service.models.draft_models import DFlashDrafter, Drafter
from executor_service.server.session import ModelSession
from executor_service.spec_decode.proposer import Proposer

METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


# ---- the reference ----------------------------------------------------------------------------------
def one_sequence_step(num_rows: int, seq_len: int, block_size: int, causal: bool = True) -> AttentionStep:
    """One sequence on blocks 0, 1, ... of a fresh cache: its last `num_rows` of `seq_len` positions computed."""
    return AttentionStep(
        backend="CPU_ATTN",
        block_table=torch.arange(blocks_needed(seq_len, block_size), dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, num_rows], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        slot_mapping=torch.arange(seq_len - num_rows, seq_len),
        max_query_len=num_rows,
        max_seq_len=seq_len,
        causal=causal,
    )


def fresh_cache(session: ModelSession, of_drafter: bool, num_tokens: int) -> KVCache:
    assert session.proposer is not None
    config = session.proposer.config.model if of_drafter else session.loaded.config
    block_size = session.kv_cache.block_size
    return KVCache(config, blocks_needed(num_tokens, block_size), block_size, torch.float32, torch.device("cpu"))


def target_features(session: ModelSession, drafter: Drafter, tokens: list[int]) -> torch.Tensor:
    """What the drafter reads of positions 0..N-2, from one pass of the target over them."""
    count, layers = len(tokens) - 1, drafter.config.target_layer_ids
    cache = fresh_cache(session, False, count)
    step = one_sequence_step(count, count, cache.block_size)
    hidden, aux = session.loaded.model(torch.tensor(tokens[:-1]), torch.arange(count), cache.layers, step, layers)
    return torch.cat(aux, dim=-1) if layers else hidden


def eagle_reference(session: ModelSession, drafter: Drafter, tokens: list[int], features: torch.Tensor) -> list[int]:
    ids, hidden = tokens[1:], drafter.combine(features)
    drafts: list[int] = []
    for _ in range(K):
        rows = len(ids)
        cache = fresh_cache(session, True, rows)
        step = one_sequence_step(rows, rows, cache.block_size)
        feedback, head = drafter(torch.tensor(ids), torch.arange(rows), hidden, cache.layers, step)
        drafts.append(int(drafter.draft_tokens(head[-1:])[0]))
        ids, hidden = ids + drafts[-1:], torch.cat([hidden, feedback[-1:]])
    return drafts


def dflash_reference(
    session: ModelSession, drafter: DFlashDrafter, tokens: list[int], features: torch.Tensor
) -> list[int]:
    config, context = drafter.config, len(tokens) - 1
    size = config.block_size
    cache = fresh_cache(session, True, context + size)
    drafter.store_context(features, torch.arange(context), torch.arange(context), cache.layers)
    block = torch.tensor([tokens[-1]] + [config.mask_token_id] * (size - 1))
    step = one_sequence_step(size, context + size, cache.block_size, causal=config.causal)
    hidden = drafter(block, torch.arange(context, context + size), cache.layers, step)
    return drafter.draft_tokens(hidden[1 : K + 1]).tolist()


@torch.inference_mode()
def reference_drafts(session: ModelSession, tokens: list[int]) -> list[int]:
    assert session.proposer is not None
    drafter = session.proposer.drafter
    features = target_features(session, drafter, tokens)
    if isinstance(drafter, DFlashDrafter):
        return dflash_reference(session, drafter, tokens, features)
    return eagle_reference(session, drafter, tokens, features)


def mismatches(session: ModelSession, proposals: list[Proposal]) -> list[tuple[Proposal, list[int]]]:
    """Each proposal whose drafts differ from the reference, with the reference's."""
    found = [(p, reference_drafts(session, p.tokens)) for p in proposals]
    return [(p, expected) for p, expected in found if p.drafts != expected]


# ---- the engine's drafts are the reference's --------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_every_proposal_equals_a_dense_recompute(method: str) -> None:
    session = spec_session(method, K, max_num_batched_tokens=BATCHED_TOKENS)
    proposals, finishes = run_recorded(session, prompts(), WRONG_AT, MAX_TOKENS)
    assert {p.request_id for p in proposals} == set(LENGTHS) and len(proposals) >= 50
    assert finishes["all"].accepted_tokens == finishes["all"].drafted_tokens > 0
    assert 0 < finishes["some"].accepted_tokens < finishes["some"].drafted_tokens
    assert finishes["w0"].accepted_tokens == 0 < finishes["w0"].drafted_tokens
    assert not mismatches(session, proposals)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash", "dflash_causal"])
def test_proposal_after_a_chunk_one_short_of_the_prompt(method: str) -> None:
    """A prefill chunk ending at the prompt's last token leaves num_computed_tokens == num_tokens - 1 before any
    token is sampled: whatever the engine does then (propose from the prompt, or wait), it must not fail."""
    session = spec_session(method, K, max_num_batched_tokens=BATCHED_TOKENS)
    prompt = [*prompts()["own"][:BATCHED_TOKENS], 1]  # chunks of 24 and 1
    proposals, _ = run_recorded(session, {"short": prompt}, {}, 6)
    assert proposals and not mismatches(session, proposals)


# ---- the comparison catches stale metadata --------------------------------------------------------------
class StaleChainSteps:
    """Corrupts EAGLE's chain steps 2..k: they reuse chain step 1's attention metadata (seq_lens and
    slot_mapping not advanced on the device) or its positions. Per proposal, from the host (`propose`) or
    from a verification on the device (`propose_verified`), the drafter runs: context pass, step 1, step 2..."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer, self.calls = proposer, 0
        self.forward, self.chain_step = proposer.drafter.forward, proposer.chain_step
        self.first_step: AttentionStep | None = None
        self.first_positions: torch.Tensor | None = None
        self.first_rotary: object = None

    def patch(self, what: str, monkeypatch: pytest.MonkeyPatch) -> None:
        for entry in ("propose", "propose_verified"):
            monkeypatch.setattr(self.proposer, entry, self.counted(getattr(self.proposer, entry)))
        if what == "metadata":
            monkeypatch.setattr(self.proposer, "chain_step", self.stale_chain_step)
        else:
            monkeypatch.setattr(self.proposer.drafter, "forward", self.stale_positions)

    def counted(self, entry: Callable[..., object]) -> Callable[..., object]:
        def proposal(*args: object) -> object:
            self.calls, self.first_step, self.first_positions, self.first_rotary = 0, None, None, None
            return entry(*args)

        return proposal

    def stale_chain_step(self, *args: torch.Tensor) -> AttentionStep:
        if self.first_step is None:
            self.first_step = self.chain_step(*args)
        return self.first_step

    def stale_positions(
        self, input_ids: torch.Tensor, positions: torch.Tensor, *rest: object, rotary: object = None
    ) -> object:
        """Steps 2..k at step 1's positions: its position ids and, where the chain looked every step's cos and sin
        up at once, its rotary too."""
        self.calls += 1
        if self.calls == 2:
            self.first_positions, self.first_rotary = positions, rotary
        elif self.calls > 2 and self.first_positions is not None:
            positions, rotary = self.first_positions, self.first_rotary
        return self.forward(input_ids, positions, *rest, rotary=rotary)


@pytest.mark.parametrize("what", ["metadata", "positions"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_stale_chain_steps_are_caught(method: str, what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    session = spec_session(method, K, max_num_batched_tokens=BATCHED_TOKENS)
    assert session.proposer is not None
    StaleChainSteps(session.proposer).patch(what, monkeypatch)
    proposals, _ = run_recorded(session, prompts(), WRONG_AT, MAX_TOKENS)
    monkeypatch.undo()  # the reference runs the drafter as it is
    wrong = mismatches(session, proposals)
    assert session.engine.spec_step is not None and session.engine.spec_step.counts["eager"] > 0
    assert len(wrong) >= 3, "stale chain steps went unnoticed"
    assert all(p.drafts[:2] == expected[:2] for p, expected in wrong)  # drafts 1 and 2 come before any staleness


@pytest.mark.parametrize("method", ["dflash", "dflash_causal"])
def test_a_dflash_block_one_position_late_is_caught(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    session = spec_session(method, K, max_num_batched_tokens=BATCHED_TOKENS)
    assert session.proposer is not None
    drafter = session.proposer.drafter
    forward = drafter.forward

    def late(input_ids: torch.Tensor, positions: torch.Tensor, *rest: object) -> object:
        return forward(input_ids, positions + 1, *rest)

    monkeypatch.setattr(drafter, "forward", late)
    proposals, _ = run_recorded(session, prompts(), WRONG_AT, MAX_TOKENS)
    monkeypatch.undo()
    assert len(mismatches(session, proposals)) >= 3, "a misplaced block went unnoticed"
