"""Lossless verification of drafted tokens (speculative sampling, Leviathan et al. / Chen et al.).

For drafts d_1..d_k drawn from the drafter's q_i and the target's p_1..p_{k+1} (the distributions the
request samples from, after temperature / top-k / top-p): accept d_i with probability min(1, p_i(d_i) /
q_i(d_i)); at the first rejection emit a token from norm(max(0, p_i - q_i)) and stop; if every draft is
accepted, emit a bonus token from p_{k+1}. The emitted tokens are distributed exactly as if the target had
sampled them one by one. A greedy drafter is a point mass (q_i(d_i) = 1), which the same rule covers.
Greedy requests (temperature 0) accept while the draft equals the target's argmax.
"""

from __future__ import annotations

import torch

from executor_service.sampling import SamplingSettings, target_probs, to_host


def verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> list[int]:
    """The accepted drafts and then the target's own token: `target_argmax` has k + 1 entries."""
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"{len(draft_tokens)} drafts need {len(draft_tokens) + 1} target tokens")
    emitted = []
    for draft, target in zip(draft_tokens, target_argmax, strict=False):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(target_argmax[-1])
    return emitted


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Emitted tokens (accepted drafts, then one corrected or bonus token) for one request.

    draft_tokens [k]; draft_probs [k, V] (None: point-mass drafts); target_probs [k + 1, V].
    """
    num_drafts = draft_tokens.shape[0]
    if target_probs.shape[0] != num_drafts + 1:
        raise ValueError(f"{num_drafts} drafts need {num_drafts + 1} rows of target probabilities")
    positions = torch.arange(num_drafts, device=target_probs.device)
    p_draft = target_probs[positions, draft_tokens]
    q_draft = draft_probs[positions, draft_tokens] if draft_probs is not None else torch.ones_like(p_draft)
    uniform = torch.rand(num_drafts, generator=generator, device=target_probs.device)
    accepted = uniform * q_draft <= p_draft  # u < p/q without dividing by a zero q
    rejected = (~accepted).nonzero()
    first_rejected = int(rejected[0]) if rejected.numel() else num_drafts
    emitted = draft_tokens[:first_rejected].tolist()
    if first_rejected == num_drafts:
        final = _sample(target_probs[num_drafts], generator)
    else:
        target = target_probs[first_rejected]
        if draft_probs is None:
            residual = target.clone()
            residual[draft_tokens[first_rejected]] = 0.0
        else:
            residual = (target - draft_probs[first_rejected]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: a rejection of probability ~0
            residual = target
        final = _sample(residual, generator)
    return [*emitted, final]


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalized non-negative weights (multinomial normalizes)."""
    return int(torch.multinomial(weights, 1, generator=generator))


def verify_batch(
    logits: torch.Tensor,
    settings: list[SamplingSettings],
    generators: list[torch.Generator | None],
    drafts: list[list[int]],
) -> list[list[int]]:
    """Emitted tokens of each request from its k + 1 rows of target logits (k = its drafts, 0 or more).

    Greedy requests need only the argmax: one device-to-host copy for the whole batch. Sampled requests
    go through `rejection_sample` against the distribution they sample from (point-mass drafts).
    """
    argmax = to_host(logits.argmax(dim=-1))
    emitted, row = [], 0
    for setting, generator, request_drafts in zip(settings, generators, drafts, strict=True):
        rows = len(request_drafts) + 1
        if setting.greedy:
            emitted.append(verify_greedy(request_drafts, argmax[row : row + rows]))
        else:
            probs = target_probs(logits[row : row + rows], setting)
            draft_tokens = torch.tensor(request_drafts, dtype=torch.int64, device=logits.device)
            emitted.append(rejection_sample(draft_tokens, None, probs, generator))
        row += rows
    return emitted
