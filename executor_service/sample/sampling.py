"""Per-request sampling settings and the distribution they give: greedy, or temperature / min-p / top-k / top-p.

`target_logprobs` is the one computation of the distribution a sampled request draws from, each row with its own
settings read from tensors (`sampling_params`): the verifier (verifier.py, on the device steps and the host path)
and the drafter's q both read it (`target_probs` / `sampled_probs` are its probabilities). The order is vLLM's:
penalties (penalties.py, on the logits before this), temperature, min-p, top-k, top-p; `race` draws a token per
row from the probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from executor_service.models.attention_step import to_device

# Below this a temperature is greedy: logits / 1e-38 overflow float32 to inf and softmax turns them into
# NaN, while at 1e-5 the distribution is already the argmax's point mass (validation and docs/api.md).
MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 1024  # a request's logit_bias entries, at most (penalties.py; the device step's table)


class DraftProbs(NamedTuple):
    """The distributions a request's drafts were drawn from, each on a few ids (draft_sampling.py; verified by
    verifier.DraftQ): ids [k, K] (target ids, distinct in a row) and their probabilities [k, K], summing to
    1 in each row."""

    ids: torch.Tensor
    probs: torch.Tensor

    def head(self, count: int) -> DraftProbs:
        """The first `count` drafts' rows (the drafts a step keeps)."""
        return DraftProbs(self.ids[:count], self.probs[:count])

    def dense(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[k, V] fp32 rows, 0 off the ids."""
        rows = torch.zeros(self.ids.shape[0], vocab, device=device)
        return rows.scatter_(1, self.ids.to(device), self.probs.to(device=device, dtype=torch.float32))


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    max_tokens: int | None = None
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    min_p: float = 0.0  # tokens below min_p x the top probability (after temperature) are dropped
    repetition_penalty: float = 1.0  # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; n: the emitted token's and the top n (logprobs.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), each token once

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether the logits change before sampling: a penalty, or a logit bias (penalties.py)."""
        penalised = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        return penalised or bool(self.logit_bias)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else read from the logits: the argmax alone decides (the device-resident step)."""
        return self.greedy and not self.has_penalties and self.logprobs is None


# A row's top-p when it sets none (1.0): no token has 2 of mass before it, so nothing is cut (at 1.0 the tail
# past the point where the float cumulative sum rounds to 1 would be).
TOP_P_OFF = 2.0


def sampling_params(settings: list[SamplingSettings]) -> list[list[float]]:
    """Each request's [temperature, top-k, top-p, min-p] row of `target_logprobs`' params (greedy: temperature 0;
    top-k 0 and min-p 0 are off, top-p TOP_P_OFF)."""
    return [
        [0.0 if s.greedy else s.temperature, float(s.top_k), s.top_p if s.top_p < 1.0 else TOP_P_OFF, s.min_p]
        for s in settings
    ]


def needs_sort(settings: list[SamplingSettings], vocab: int) -> bool:
    """Whether any sampled request sets top-k or top-p (the device steps then sort each row once)."""
    return any((0 < s.top_k < vocab or s.top_p < 1.0) and not s.greedy for s in settings)


def host_sort(settings: list[SamplingSettings], vocab: int) -> bool | int:
    """`target_logprobs`' `sort` for rows of these settings off the device steps: True (sort each row) only where
    some request sets top-p; where only top-k is set, the largest k (each row's k largest by torch.topk, far
    cheaper than a sort on the CPU); False: neither."""
    if any(s.top_p < 1.0 for s in settings):
        return True
    return max((s.top_k for s in settings if 0 < s.top_k < vocab), default=False)


def target_logprobs(logits: torch.Tensor, params: torch.Tensor, sort: bool | int) -> torch.Tensor:
    """Log-probabilities [R, V] that each row of logits [R, V] samples from (-inf outside its min-p / top-k / top-p
    set) under its own params [R, 4] (sampling_params). The row's maximum is subtracted first: penalised logits may
    be as large as float32 allows, and dividing those by a small temperature would overflow to inf.

    `sort` True: each row is sorted once for top-k and top-p (needs_sort; the device steps); an int K: top-k only,
    every k at most K, read from each row's K largest (host_sort); False: no row sets either. Each gives a row the
    same numbers, so a row's distribution does not depend on its batch."""
    logits = logits.float()
    temperature = params[:, :1].clamp(min=MIN_TEMPERATURE)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    # min-p: p >= min_p * p_max, and p / p_max = exp(scaled) (the maximum's scaled logit is 0).
    scaled = scaled.masked_fill(scaled < torch.log(params[:, 3:4]), float("-inf"))
    vocab = scaled.shape[-1]
    if sort is True:
        ordered, order = scaled.sort(dim=-1, descending=True)
        top_k = params[:, 1:2].long()
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kth = ordered.gather(1, k - 1)  # ties with the k-th are kept
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly earlier tokens in the order
        ordered = ordered.masked_fill((before >= params[:, 2:3]) & (before > 0.0), float("-inf"))  # the top stays
        scaled = torch.empty_like(scaled).scatter_(1, order, ordered)
    elif sort:
        top_k = params[:, 1:2].long()
        largest = torch.topk(scaled, int(sort), dim=-1).values
        kth = largest.gather(1, top_k.clamp(1, int(sort)) - 1)  # ties with the k-th are kept
        kth = torch.where((top_k > 0) & (top_k < vocab), kth, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sampled_probs(logits: torch.Tensor, settings: list[SamplingSettings]) -> torch.Tensor:
    """The probabilities [N, V] each row of logits samples from under its own settings: target_logprobs."""
    params = to_device(sampling_params(settings), torch.float32, logits.device).view(len(settings), 4)
    return target_logprobs(logits, params, host_sort(settings, logits.shape[-1])).exp()


def target_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The probabilities [..., V] of rows of logits [..., V] that share one request's settings: target_logprobs."""
    rows = logits.reshape(-1, logits.shape[-1])
    return sampled_probs(rows, [settings] * rows.shape[0]).view(logits.shape)


def is_distribution(weights: torch.Tensor) -> torch.Tensor:
    """Per row of weights [..., V]: finite, >= 0 and a finite, positive sum (what a draw needs)."""
    total = weights.sum(dim=-1)
    return torch.isfinite(weights).all(dim=-1) & (weights >= 0).all(dim=-1) & (total > 0) & torch.isfinite(total)


def race(weights: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race of unnormalised weights [N, V] against noise [N, V] ~ Exp(1): argmax of
    weights / noise, which is what torch.multinomial draws (without its host checks). Also whether each row
    was a distribution; rows that are not race uniform weights instead."""
    valid = is_distribution(weights)
    safe = torch.where(valid[:, None], weights, torch.ones_like(weights))
    return (safe / noise).argmax(dim=-1), valid


def to_host(tokens: torch.Tensor) -> list[int]:
    """The sampled ids on the host. On GPUs the wait happens in CUDA event synchronize, which releases
    the GIL: the asyncio loop streams the previous step's tokens while this step runs (tolist() would hold
    the GIL for the whole step)."""
    if not tokens.is_cuda:
        return tokens.tolist()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
