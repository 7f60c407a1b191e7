"""Sampled drafting: a sampled request's drafts are drawn from the drafter's own distribution q, and q is kept
for its verification.

Greedy drafts are a point mass: the rejection sampler accepts draft d with probability p(d), the target's
probability of the drafter's argmax. At T = 0.7 that is about 0.4 for the first draft of our drafters, while
their greedy drafts match the target's argmax two times in three. Drawing d from q and verifying against q
(accept with probability min(1, p(d) / q(d)), else emit from norm(max(0, p - q))) accepts sum_x min(p(x),
q(x)) on average: 1 when the drafter knows the target's distribution, and the emitted tokens are the
target's distribution whatever q is. q is the drafter's logits under the request's own temperature, min-p,
top-k and top-p (`sampled_probs`, the target's recipe), so it spreads its mass where p does, kept on the
drafter's DRAFT_SUPPORT most likely ids.

Greedy requests keep their argmax drafts. A draft's noise is counter-based (device_sampling.py), keyed by the
request's seed and the position the draft is for (a stream of its own): a seeded request draws the same drafts
run to run and in any batch, with a few launches per pick for all requests (a chain step, or DFlash's block).
"""

from __future__ import annotations

import torch

from executor_service.engine.request import Request
from executor_service.models.attention_step import to_device
from executor_service.models.fused_ops import argmax
from executor_service.sample.device_sampling import (
    DRAFT_STREAM,
    exponential_noise,
    position_keys,
    seed_value,
    step_keys,
)
from executor_service.sample.sampling import (
    MIN_TEMPERATURE,
    DraftProbs,
    host_sort,
    race,
    sampling_params,
    target_logprobs,
)

# Ids each drawn draft's q keeps: the drafter's most likely ones, renormalised. The draft is drawn from exactly
# that q, so verification stays exact; what the drafter puts past them is rarely drawn at T <= 1 anyway. A
# request keeps k x 32 ids and probabilities instead of k full rows (1.4 MB at k = 7 and 49k ids, 4 MB at
# 128k), and verification expands them one pass of rows at a time.
DRAFT_SUPPORT = 32


class DraftSampler:
    """Picks each draft position's ids for the proposing requests, [B] from the drafter's logits [B, Vd], and
    records q of the sampled ones; `probs_of` hands each request its DraftProbs in the target's ids."""

    def __init__(self, requests: list[Request], vocab_ids: torch.Tensor | None, support: int = DRAFT_SUPPORT) -> None:
        self.rows = [i for i, r in enumerate(requests) if not r.settings.greedy]
        self.settings = [requests[i].settings for i in self.rows]
        self.seeds = [requests[i].seed for i in self.rows]
        self.first = [requests[i].num_tokens for i in self.rows]  # the position of each one's first draft
        self.picked = 0  # positions drawn so far
        self.vocab_ids, self.support = vocab_ids, support  # vocab_ids: the draft vocabulary's target ids
        self.index: torch.Tensor | None = None
        self.probs: list[DraftProbs] = []  # per pick, [S, positions, K] each

    @staticmethod
    def wanted(requests: list[Request]) -> bool:
        return any(not r.settings.greedy for r in requests)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft ids (the drafter's vocabulary) of one position [B, Vd] -> [B], or of n positions at once
        [B, n, Vd] -> [B, n] (DFlash's block): argmax rows, and `draw_from_q` for the sampled rows."""
        ids = argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
        if not self.rows:
            return ids
        if self.index is None:
            self.index = to_device(self.rows, torch.int64, logits.device)
        positions = logits.shape[1] if logits.dim() == 3 else 1
        rows = logits[self.index].reshape(len(self.rows) * positions, -1)  # request-major: its positions in turn
        settings = [s for s in self.settings for _ in range(positions)]
        params = to_device(sampling_params(settings), torch.float32, rows.device).view(len(settings), 4)
        keys = self._keys(positions, rows.device)
        drawn, kept, q = draw_from_q(rows, params, keys, host_sort(settings, rows.shape[-1]), self.support)
        kept_ids = kept if self.vocab_ids is None else self.vocab_ids[kept]  # the target's ids
        shape = (len(self.rows), positions, q.shape[-1])
        self.probs.append(DraftProbs(kept_ids.view(shape), q.view(shape)))
        ids[self.index] = drawn.view(len(self.rows), *ids.shape[1:])
        return ids

    def _keys(self, positions: int, device: torch.device) -> torch.Tensor:
        """[S * positions] the noise keys of this pick's rows (request-major): seed and each draft's position."""
        at = [first + self.picked + j for first in self.first for j in range(positions)]
        seeds = [seed for seed in self.seeds for _ in range(positions)]
        self.picked += positions
        keys = [step_keys(seed_value(s), position, DRAFT_STREAM) for s, position in zip(seeds, at, strict=True)]
        return to_device(keys, torch.int64, device)

    def probs_of(self, count: int) -> list[DraftProbs | None]:
        """Each proposing request's q of its k drafts (None: greedy, a point mass)."""
        found: list[DraftProbs | None] = [None] * count
        if not self.probs:
            return found
        ids = torch.cat([p.ids for p in self.probs], dim=1)  # [S, k, K]
        probs = torch.cat([p.probs for p in self.probs], dim=1)
        for j, row in enumerate(self.rows):
            found[row] = DraftProbs(ids[j], probs[j])
        return found


def draw_from_q(
    logits: torch.Tensor, params: torch.Tensor, keys: torch.Tensor, sort: bool | int, support: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft per row of the drafter's logits [R, Vd] under each row's params [R, 4] (sampling_params), drawn
    with each row's noise key [R]: the ids (drafter's vocabulary) [R], and the q it was drawn from, on the
    `support` most likely ids [R, K] with their probabilities [R, K] (renormalised). A row whose q is not a
    distribution (a faulty drafter) draws uniformly among the ids it kept, and uniform is the q it keeps: still
    what the draft was drawn from, so verification stays exact. A greedy row (temperature 0) takes the argmax,
    its q a point mass on it. The host path's sampler and the device step both draw here, so a seeded request
    drafts the same on either."""
    q, kept = target_logprobs(logits, params, sort).exp().topk(min(support, logits.shape[-1]), dim=-1)
    slot, valid = race(q, exponential_noise(keys, q.shape[-1]))
    q = torch.where(valid[:, None], q / q.sum(dim=-1, keepdim=True), torch.full_like(q, 1.0 / q.shape[-1]))
    drawn = kept.gather(1, slot[:, None])[:, 0]
    greedy = params[:, 0] < MIN_TEMPERATURE
    top = argmax(logits)
    point = torch.zeros_like(q)
    point[:, 0] = 1.0
    ids = torch.where(greedy, top, drawn)
    kept = torch.where(greedy[:, None], top[:, None].expand_as(kept), kept)
    return ids, kept, torch.where(greedy[:, None], point, q)


class StepDraws:
    """A device step's drafts drawn from q: each request's params [B, 4] and seed [B], the position of its first
    draft [B] (derived on the device from the accepted count), the step variant's sort. Each pick's q is kept
    for the step's output (`q`); a greedy request's drafts are the argmax with point masses (`draw_from_q`). The
    keys are the host sampler's (seed, the position a draft is for), so either path draws the same drafts."""

    def __init__(
        self,
        params: torch.Tensor,
        seed: torch.Tensor,
        first: torch.Tensor,
        sort: bool,
        vocab_ids: torch.Tensor | None,
        support: int = DRAFT_SUPPORT,
    ) -> None:
        self.params, self.seed, self.first, self.sort = params, seed, first, sort
        self.vocab_ids, self.support = vocab_ids, support
        self.picked = 0
        self.ids: list[torch.Tensor] = []  # per pick [B, positions, K], target ids
        self.probs: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft ids (the drafter's vocabulary) of one position [B, Vd] -> [B], or of n at once [B, n, Vd] -> [B, n]."""
        count, positions = logits.shape[0], logits.shape[1] if logits.dim() == 3 else 1
        at = self.first[:, None] + self.picked + torch.arange(positions, device=logits.device)[None, :]
        (keys,) = position_keys(self.seed, at, (DRAFT_STREAM,))
        params = self.params[:, None, :].expand(count, positions, -1).reshape(count * positions, -1)
        rows = logits.reshape(count * positions, -1)
        ids, kept, q = draw_from_q(rows, params, keys, self.sort, self.support)
        kept = kept if self.vocab_ids is None else self.vocab_ids[kept]
        self.ids.append(kept.view(count, positions, -1))
        self.probs.append(q.view(count, positions, -1))
        self.picked += positions
        return ids.view(logits.shape[:-1])

    def q(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafts' q in the target's ids: ids [B, k, K] and probabilities [B, k, K] (verifier.DraftQ)."""
        return torch.cat(self.ids, dim=1), torch.cat(self.probs, dim=1)
