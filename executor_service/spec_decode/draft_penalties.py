"""Penalised drafting: a penalised request's drafts are picked from the drafter's logits under the penalties that
the target applies to the rows verifying them, so the drafter stops proposing the repeats the target would reject.

The verifier penalises row j of a chain as if the request's history (prompt and output, the newest token
included) and drafts 0..j-1 had been emitted (penalties.py), and draft j is checked against row j. So each pick
penalises the drafter's logits with the request's counts plus the drafts picked before it (`pick` counts every
draft it picks), by the verifier's own formula (`penalise_values`); the choice is then the argmax, or a draw
from q where sampled requests draw their drafts (draft_sampling.py: penalties first, then temperature, min-p,
top-k, top-p, the target's recipe). DFlash's block pass gives every position's logits at once; its picks are
still taken position by position, each counting the ones before it (no drafter pass between them). A tree's
candidates (tree_drafting.py) are ranked under the history alone, the same for every node of a request: a
node's ancestors are not counted.

A request's logit bias (target ids) is added to the drafter's logits before the penalties, as the verifier adds
it to the target's, so the drafter stops proposing the tokens a request bans.

Counts are indexed by target ids. EAGLE-3's head drafts over a reduced vocabulary: the counts are gathered once
per proposal at each draft id's target id (`vocab_ids`), so the picks penalise the head's own rows; d2t maps
draft ids to distinct target ids (a draft vocabulary is a subset of the target's), so counting a pick at its
draft id counts its target id.

The device step builds its penalties from its PenaltyTable's slots after it counted the tokens it emitted
(`from_table`, inside the step's graph), the host path from each request's TokenCounts (`from_requests`); both
pick through `pick`. Verification is untouched: the drafts change, never what is emitted (lossless). Requests
without penalties in a penalised batch have (1, 0, 0), which leaves their logits as they are; a batch without
penalised requests builds none (no op in the greedy, sampled and sorted variants).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from executor_service.engine.request import Request
from executor_service.models.attention_step import to_device
from executor_service.sample.penalties import current_counts, dense_bias, penalise_values
from executor_service.spec_decode.device_penalties import penalty_params
from executor_service.spec_decode.verifier import StepPenalties

Choose = Callable[[torch.Tensor], torch.Tensor]  # the drafter's logits [B, Vd] -> draft ids [B]


class DraftPenalties:
    """B proposing requests' prompt tokens and counts so far (history, then the drafts picked) over the drafter's
    vocabulary, and their (repetition, presence, frequency)."""

    def __init__(self, in_prompt: torch.Tensor, counts: torch.Tensor, params: torch.Tensor, bias: torch.Tensor) -> None:
        """`in_prompt` [B, Vd] bool and `counts` [B, Vd] int32 over the drafter's ids, fresh tensors this object
        writes (advanced indexing copies); `params` [B, 3]; `bias` [B, Vd] float32, each request's logit bias."""
        self.in_prompt, self.counts, self.bias = in_prompt[:, None], counts, bias[:, None]
        self.repetition, self.presence, self.frequency = (params[:, i, None, None] for i in range(3))
        self.ones = torch.ones_like(counts[:, :1])  # one more occurrence of each pick

    @classmethod
    def from_table(cls, penalties: StepPenalties, vocab_ids: torch.Tensor | None) -> DraftPenalties:
        """The device step's: each request's slot (-1: the zero scratch slot) after the step counted its emitted
        tokens, its params and the logit bias the verifier added; `vocab_ids` [Vd]: each draft id's target id
        (None: the same ids). One gather per table, no host work: it runs inside the step's graph."""
        table, slot, params, bias = penalties.table, penalties.slot, penalties.params, penalties.bias
        assert table.output is not None and table.in_prompt is not None
        if vocab_ids is None:
            return cls(table.in_prompt[slot], table.output[slot], params, bias)
        index = (slot[:, None], vocab_ids[None, :])
        return cls(table.in_prompt[index], table.output[index], params, bias[:, vocab_ids])

    @classmethod
    def from_requests(
        cls, requests: Sequence[Request], vocab: int, vocab_ids: torch.Tensor | None, device: torch.device
    ) -> DraftPenalties | None:
        """The host path's, from each request's TokenCounts brought up to its output (None: nobody is penalised)."""
        if not any(r.settings.has_penalties for r in requests):
            return None
        zeros = torch.zeros(vocab, dtype=torch.int32, device=device)
        found = [current_counts(r, vocab, device) if r.settings.has_penalties else None for r in requests]
        in_prompt = torch.stack([zeros.bool() if c is None else c.in_prompt for c in found])
        counts = torch.stack([zeros if c is None else c.output for c in found])
        bias = dense_bias([r.settings for r in requests], vocab, device)
        if vocab_ids is not None:
            in_prompt, counts, bias = in_prompt[:, vocab_ids], counts[:, vocab_ids], bias[:, vocab_ids]
        params = to_device(penalty_params(list(requests)), torch.float32, device).view(len(requests), 3)
        return cls(in_prompt, counts, params, bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 logits [B * n, Vd] (each request's n rows in turn), every row penalised by its request's counts
        so far."""
        by_request = logits.view(self.counts.shape[0], -1, logits.shape[-1]).float() + self.bias
        counts = self.counts[:, None]
        out = penalise_values(by_request, self.in_prompt, counts, self.repetition, self.presence, self.frequency)
        return out.view(logits.shape)

    def pick(self, logits: torch.Tensor, choose: Choose) -> torch.Tensor:
        """Draft ids (the drafter's vocabulary) [B] of one position from its logits [B, Vd], or [B, n] of n
        positions [B, n, Vd] in turn: each chosen from the logits penalised by the counts so far, then counted."""
        if logits.dim() == 3:
            return torch.stack([self.pick(logits[:, i], choose) for i in range(logits.shape[1])], dim=1)
        ids = choose(self.apply(logits))
        self.counts.scatter_add_(1, ids[:, None], self.ones)
        return ids
