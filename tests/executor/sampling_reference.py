"""A plain reference of the target distribution for the tests of sampling.target_logprobs: one request's
settings, each filter written out as its definition (temperature, min-p relative to the top probability, the
top-k values with ties, the top-p nucleus of strictly more likely mass), with no tensors of settings and no
shared code with the executor's."""

from __future__ import annotations

import torch

from executor_service.sample.sampling import SamplingSettings


def reference_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The distribution of each row of logits [..., V] under `settings` (a sampled request's)."""
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / settings.temperature
    vocab = scaled.shape[-1]
    if settings.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < settings.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < settings.top_k < vocab:
        kth = torch.topk(scaled, settings.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= settings.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
