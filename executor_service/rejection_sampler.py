"""Lossless verification of drafted tokens (speculative sampling, Leviathan et al. / Chen et al.).

For drafts d_1..d_k drawn from the drafter's q_i and the target's p_1..p_{k+1} (the distributions the
request samples from, after penalties / temperature / min-p / top-k / top-p; p_{i+1} penalised as if d_1..d_i
had been emitted: penalties.py): accept d_i with probability min(1, p_i(d_i) /
q_i(d_i)); at the first rejection emit a token from norm(max(0, p_i - q_i)) and stop; if every draft is
accepted, emit a bonus token from p_{k+1}. The emitted tokens are distributed exactly as if the target had
sampled them one by one. Our drafters are greedy (the argmax of their own logits), so q_i is the point mass
on d_i (q_i(d_i) = 1): exactly the distribution the drafts were drawn from, which the same rule covers.
Greedy requests (temperature 0) accept while the draft equals the target's argmax (of the penalised logits).

A faulty drafter's id outside the vocabulary, or logits that give no distribution, fail that request
alone: `verify_batch` returns a `VerifyError` in its place and verifies the others.
"""

from __future__ import annotations

import torch

from executor_service.penalties import History, penalised_logits
from executor_service.sampling import SamplingSettings, draw, sample, target_probs, to_host


class VerifyError(RuntimeError):
    """One request's verification failed (drafts outside the vocabulary, logits that are not finite)."""


def check_drafts(draft_tokens: list[int], vocab_size: int) -> VerifyError | None:
    """An error if a draft id is outside [0, vocab_size): a faulty drafter. Host lists, so no device work."""
    if draft_tokens and (min(draft_tokens) < 0 or max(draft_tokens) >= vocab_size):
        bad = [t for t in draft_tokens if not 0 <= t < vocab_size][:4]
        return VerifyError(f"the drafter proposed ids outside the vocabulary [0, {vocab_size}): {bad}")
    return None


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
    num_drafts, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    if target_probs.shape[0] != num_drafts + 1:
        raise ValueError(f"{num_drafts} drafts need {num_drafts + 1} rows of target probabilities")
    draft_tokens = draft_tokens.long()
    outside = (draft_tokens < 0) | (draft_tokens >= vocab)  # a faulty drafter: never index with these
    safe_tokens = draft_tokens.clamp(0, vocab - 1)
    positions = torch.arange(num_drafts, device=target_probs.device)
    p_draft = target_probs[positions, safe_tokens]
    q_draft = draft_probs[positions, safe_tokens] if draft_probs is not None else torch.ones_like(p_draft)
    uniform = torch.rand(num_drafts, generator=generator, device=target_probs.device)
    accepted = uniform * q_draft <= p_draft  # u < p/q without dividing by a zero q
    first = accepted.long().cumprod(0).sum()  # drafts before the first rejection
    first_rejected, num_outside, *drafted = to_host(torch.cat([first[None], outside.sum()[None], draft_tokens]))
    if num_outside:
        raise VerifyError(f"the drafter proposed ids outside the vocabulary [0, {vocab}): {drafted[:4]}")
    if first_rejected == num_drafts:
        weights = target_probs[num_drafts]
    else:
        target = target_probs[first_rejected]
        if draft_probs is None:
            residual = target.clone()
            residual[drafted[first_rejected]] = 0.0
        else:
            residual = (target - draft_probs[first_rejected]).clamp_min(0.0)
        weights = torch.where(residual.sum() > 0.0, residual, target)  # p == q up to rounding: probability ~0
    final, valid = draw(weights, generator)
    final_token, is_valid = to_host(torch.stack([final, valid.long()]))
    if not is_valid:
        raise VerifyError("the target's probabilities are not a distribution (inf or NaN)")
    return [*drafted[:first_rejected], final_token]


def verify_batch(
    logits: torch.Tensor,
    settings: list[SamplingSettings],
    generators: list[torch.Generator | None],
    drafts: list[list[int]],
    histories: list[History | None] | None = None,
) -> list[list[int] | VerifyError]:
    """Emitted tokens of each request from its k + 1 rows of target logits (k = its drafts, 0 or more), or
    the VerifyError that fails that request alone (the others are verified as usual). `histories` (the
    requests) give the tokens that penalties count; without them no penalty applies.

    Greedy requests need only the argmax: one device-to-host copy for the whole batch, which also brings
    whether each row's logits are finite (argmax lands on a NaN or +inf if there is one). Sampled requests
    go through `rejection_sample` against the distribution they sample from (point-mass drafts).
    """
    vocab, num_rows = logits.shape[-1], logits.shape[0]
    raw_argmax = logits.argmax(dim=-1)
    finite = torch.isfinite(logits.gather(-1, raw_argmax[:, None])[:, 0])
    processed = penalised_logits(logits, settings, histories or [None] * len(settings), drafts)
    argmax = raw_argmax if processed is logits else processed.argmax(dim=-1)
    host = to_host(torch.cat([argmax, finite.long()]))
    emitted: list[list[int] | VerifyError] = []
    undrafted: list[tuple[int, int]] = []  # (request, row) sampled without drafts: drawn together below
    row = 0
    for setting, generator, request_drafts in zip(settings, generators, drafts, strict=True):
        rows = len(request_drafts) + 1
        error = check_drafts(request_drafts, vocab)
        if error is None and not all(host[num_rows + row : num_rows + row + rows]):
            error = VerifyError("the target's logits are not finite (inf or NaN)")
        if error is not None:
            emitted.append(error)
        elif setting.greedy:
            emitted.append(verify_greedy(request_drafts, host[row : row + rows]))
        elif not request_drafts:
            undrafted.append((len(emitted), row))
            emitted.append([])
        else:
            emitted.append(_sample_one(processed[row : row + rows], setting, generator, request_drafts))
        row += rows
    if undrafted:  # one batched draw and one host copy for them all, not a draw and a copy per request
        requests, rows_of = [i for i, _ in undrafted], [r for _, r in undrafted]
        drawn = sample(processed[rows_of], [settings[i] for i in requests], [generators[i] for i in requests])
        for i, token in zip(requests, drawn, strict=True):
            emitted[i] = [token] if isinstance(token, int) else VerifyError(str(token))
    return emitted


def _sample_one(
    logits: torch.Tensor, setting: SamplingSettings, generator: torch.Generator | None, drafts: list[int]
) -> list[int] | VerifyError:
    """One sampled request's verification; a failure of its own numbers is its error, not the batch's."""
    try:
        probs = target_probs(logits, setting)
        draft_tokens = torch.tensor(drafts, dtype=torch.int64, device=logits.device)
        return rejection_sample(draft_tokens, None, probs, generator)
    except Exception as err:  # whatever its numbers raise fails this request only
        return err if isinstance(err, VerifyError) else VerifyError(f"sampling failed: {err}")
