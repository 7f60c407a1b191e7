"""Sampled drafting: a sampled request's drafts are drawn from the drafter's own distribution q, and q is kept
for its verification.

Greedy drafts are a point mass: the rejection sampler accepts draft d with probability p(d), the target's
probability of the drafter's argmax. At T = 0.7 that is about 0.4 for the first draft of our drafters, while
their greedy drafts match the target's argmax two times in three. Drawing d from q and verifying against q
(accept with probability min(1, p(d) / q(d)), else emit from norm(max(0, p - q))) accepts sum_x min(p(x),
q(x)) on average: 1 when the drafter knows the target's distribution, and the emitted tokens are the
target's distribution whatever q is. q is the drafter's logits under the request's own temperature, min-p,
top-k and top-p (`sampled_probs`, the target's recipe), so it spreads its mass where p does.

Greedy requests keep their argmax drafts. A seeded request draws its drafts' noise from its own generator
(after the drafts, its verification draws from it too: reproducible run to run); the others share the
device's default generator: one launch per pick for all of them (a chain step, or DFlash's whole block).
"""

from __future__ import annotations

import torch

from executor_service.attention_step import to_device
from executor_service.fused_ops import argmax
from executor_service.request import Request
from executor_service.sampling import exponential_noise, race, sampled_probs


class DraftSampler:
    """Picks each draft position's ids for the proposing requests, [B] from the drafter's logits [B, Vd], and
    records q of the sampled ones; `probs_of` hands each request its [k, V] rows in the target's vocabulary."""

    def __init__(self, requests: list[Request], vocab_ids: torch.Tensor | None, vocab_size: int) -> None:
        self.rows = [i for i, r in enumerate(requests) if not r.settings.greedy]
        self.settings = [requests[i].settings for i in self.rows]
        self.generators = [requests[i].generator if requests[i].settings.seed is not None else None for i in self.rows]
        self.vocab_ids, self.vocab_size = vocab_ids, vocab_size  # vocab_ids: the draft vocabulary's target ids
        self.index: torch.Tensor | None = None
        self.probs: list[torch.Tensor] = []  # per pick, [S, positions, Vd]

    @staticmethod
    def wanted(requests: list[Request]) -> bool:
        return any(not r.settings.greedy for r in requests)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft ids (the drafter's vocabulary) of one position [B, Vd] -> [B], or of n positions at once
        [B, n, Vd] -> [B, n] (DFlash's block): argmax rows, and draws from q for sampled rows. A row whose q is
        not a distribution (a faulty drafter) draws from uniform weights, and uniform is the q it keeps:
        still what the draft was drawn from, so verification stays exact."""
        ids = argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
        if not self.rows:
            return ids
        if self.index is None:
            self.index = to_device(self.rows, torch.int64, logits.device)
        positions = logits.shape[1] if logits.dim() == 3 else 1
        rows = logits[self.index].reshape(len(self.rows) * positions, -1)  # request-major: its positions in turn
        settings = [s for s in self.settings for _ in range(positions)]
        generators = [g for g in self.generators for _ in range(positions)]
        q = sampled_probs(rows, settings)
        drawn, valid = race(q, exponential_noise(generators, q.shape[-1], q.device))
        q = torch.where(valid[:, None], q, torch.full_like(q, 1.0 / q.shape[-1]))
        self.probs.append(q.view(len(self.rows), positions, -1))
        ids[self.index] = drawn.view(len(self.rows), *ids.shape[1:])
        return ids

    def probs_of(self, count: int) -> list[torch.Tensor | None]:
        """Each proposing request's q rows [k, V] in the target's vocabulary (None: greedy, a point mass)."""
        found: list[torch.Tensor | None] = [None] * count
        if not self.probs:
            return found
        q = torch.cat(self.probs, dim=1)  # [S, k, Vd]
        if self.vocab_ids is not None:  # a reduced vocabulary (EAGLE-3): the target's other ids get 0
            full = q.new_zeros(q.shape[0], q.shape[1], self.vocab_size)
            q = full.index_copy_(2, self.vocab_ids, q)
        for j, row in enumerate(self.rows):
            found[row] = q[j]
        return found
