"""Lossless verification of drafted tokens (speculative sampling, Leviathan et al. / Chen et al.).

For drafts d_1..d_k drawn from the drafter's q_i and the target's p_1..p_{k+1} (the distributions the
request samples from, after penalties / temperature / min-p / top-k / top-p; p_{i+1} penalised as if d_1..d_i
had been emitted: penalties.py): accept d_i with probability min(1, p_i(d_i) /
q_i(d_i)); at the first rejection emit a token from norm(max(0, p_i - q_i)) and stop; if every draft is
accepted, emit a bonus token from p_{k+1}. The emitted tokens are distributed exactly as if the target had
sampled them one by one. A sampled request's drafts are drawn from the drafter's q (draft_sampling.py) and
verified against it; argmax drafts are a point mass on d_i (q_i(d_i) = 1), which the same rule covers.
Greedy requests (temperature 0) accept while the draft equals the target's argmax (of the penalised logits).

All sampled requests of a step are verified together on the device (`rejection_sample_batch`): their target
rows in one pass, the first rejection of each from a cumulative product, the residual or bonus row drawn by an
exponential race, and one host copy for the whole batch. Only a seeded request's random draws stay per
request, because it has its own generator (it must not depend on its batch): k uniforms, then V exponentials,
the order the per-request sampler used, so seeded outputs did not change. Unseeded requests draw together.

A faulty drafter's id outside the vocabulary, or logits that give no distribution, fail that request
alone: `verify_batch` returns a `VerifyError` in its place and verifies the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from executor_service.attention_step import to_device
from executor_service.penalties import ROWS_PER_PASS, History, penalised_logits
from executor_service.sampling import DraftProbs, SamplingSettings, race, sampled_probs, to_host
from executor_service.verifier import verify_host_greedy


class VerifyError(RuntimeError):
    """One request's verification failed (drafts outside the vocabulary, logits that are not finite)."""


def check_drafts(draft_tokens: list[int], vocab_size: int) -> VerifyError | None:
    """An error if a draft id is outside [0, vocab_size): a faulty drafter. Host lists, so no device work."""
    if draft_tokens and (min(draft_tokens) < 0 or max(draft_tokens) >= vocab_size):
        bad = [t for t in draft_tokens if not 0 <= t < vocab_size][:4]
        return VerifyError(f"the drafter proposed ids outside the vocabulary [0, {vocab_size}): {bad}")
    return None


class Verdict(NamedTuple):
    """Per request of a batched rejection pass, on the device: drafts accepted, the token after them, and
    whether that token's weights were a distribution (finite, >= 0, positive sum)."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor


def rejection_sample_batch(
    probs: torch.Tensor,
    drafts: Sequence[list[int]],
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
) -> Verdict:
    """Verify every request's drafts at once: probs [R, V] holds each request's k + 1 target rows in turn,
    drafts its k ids (in the vocabulary: check_drafts), draft_probs [sum k, V] the drafter's rows (None: point
    masses). No host copy: the caller copies the Verdict with whatever else it reads.

    A request with a generator draws from it in the per-request sampler's order (random_draws): k uniforms,
    then V exponentials for the final token (an exponential race, argmax of weights / noise: exactly what
    torch.multinomial draws). Requests without one share the device's default generator.
    """
    device, vocab, count = probs.device, probs.shape[-1], len(drafts)
    lengths = [len(d) for d in drafts]
    width = max(lengths, default=0)
    starts, draft_rows, slots, padded = [], [], [], []
    for i, request_drafts in enumerate(drafts):
        starts.append(len(draft_rows) + i)  # each request's first row: its drafts and bonus rows before it
        draft_rows += range(starts[-1], starts[-1] + len(request_drafts))
        slots += range(i * width, i * width + len(request_drafts))
        padded += [*request_drafts, *[0] * (width + 1 - len(request_drafts))]
    flat = [t for d in drafts for t in d]
    host = [*starts, *lengths, *padded, *draft_rows, *slots, *flat]
    sizes = [count, count, count * (width + 1), len(flat), len(flat), len(flat)]
    start, length, padded_ids, rows, slot, flat_ids = to_device(host, torch.int64, device).split(sizes)
    uniforms, noise = random_draws(lengths, generators, vocab, device)
    grid = torch.zeros(count * width, dtype=torch.int64, device=device)  # 0 past a request's drafts: a stop
    if flat:
        p_draft = probs[rows, flat_ids]
        q_draft = draft_probs[torch.arange(len(flat), device=device), flat_ids] if draft_probs is not None else 1.0
        grid[slot] = (uniforms * q_draft <= p_draft).long()  # u < p/q without dividing by a zero q
    num_accepted = grid.view(count, width).cumprod(dim=1).sum(dim=1)  # drafts before the first rejection
    final = probs[start + num_accepted]
    weights = residual_weights(final, padded_ids.view(count, width + 1), num_accepted, length, draft_probs)
    return Verdict(num_accepted, *race(weights, noise))


def random_draws(
    lengths: list[int], generators: Sequence[torch.Generator | None], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms for every draft [sum k] and exponential noise [S, V], in request order. A request with its own
    generator draws k uniforms, then V exponentials, from it: the only launches per request, because torch
    has no batched draw over many generators. Requests without one (None) draw from the device's default
    generator together: two launches for all of them."""
    shared = [i for i, generator in enumerate(generators) if generator is None]
    if len(shared) == len(lengths):
        return torch.rand(sum(lengths), device=device), torch.empty(len(lengths), vocab, device=device).exponential_()
    shared_uniforms = torch.rand(sum(lengths[i] for i in shared), device=device).split([lengths[i] for i in shared])
    shared_noise = torch.empty(len(shared), vocab, device=device).exponential_()
    place = {request: j for j, request in enumerate(shared)}
    uniforms, noise = [], []
    for request, (num_drafts, generator) in enumerate(zip(lengths, generators, strict=True)):
        if generator is None:
            uniforms.append(shared_uniforms[place[request]])
            noise.append(shared_noise[place[request]])
            continue
        if num_drafts:
            uniforms.append(torch.rand(num_drafts, generator=generator, device=device))
        noise.append(torch.empty(vocab, device=device).exponential_(generator=generator))
    return torch.cat(uniforms) if uniforms else torch.empty(0, device=device), torch.stack(noise)


def residual_weights(
    final: torch.Tensor,
    padded: torch.Tensor,
    num_accepted: torch.Tensor,
    length: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> torch.Tensor:
    """Each request's weights for its last token [S, V]: its bonus row when every draft was accepted, else
    max(0, p - q) at the rejected draft (unnormalised; p where p == q up to rounding, probability ~0)."""
    if draft_probs is None or draft_probs.shape[0] == 0:
        residual = final.scatter(1, padded.gather(1, num_accepted[:, None]), 0.0)
    else:
        first_draft = length.cumsum(0) - length
        rejected = (first_draft + num_accepted).clamp(max=draft_probs.shape[0] - 1)
        residual = (final - draft_probs[rejected]).clamp_min(0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0.0, residual, final)
    return torch.where((num_accepted == length)[:, None], final, residual)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Emitted tokens (accepted drafts, then one corrected or bonus token) for one request: the batched pass
    with a batch of one. draft_tokens [k]; draft_probs [k, V] (None: point-mass drafts); target_probs [k + 1, V].
    """
    drafted = draft_tokens.long().tolist()
    if target_probs.shape[0] != len(drafted) + 1:
        raise ValueError(f"{len(drafted)} drafts need {len(drafted) + 1} rows of target probabilities")
    error = check_drafts(drafted, target_probs.shape[-1])
    if error is not None:
        raise error
    verdict = rejection_sample_batch(target_probs, [drafted], draft_probs, [generator])
    num_accepted, token, valid = to_host(torch.cat([verdict.num_accepted, verdict.tokens, verdict.valid.long()]))
    if not valid:
        raise VerifyError("the target's probabilities are not a distribution (inf or NaN)")
    return [*drafted[:num_accepted], token]


def verify_batch(
    logits: torch.Tensor,
    settings: list[SamplingSettings],
    generators: list[torch.Generator | None],
    drafts: list[list[int]],
    histories: list[History | None] | None = None,
    draft_probs: list[DraftProbs | None] | None = None,
) -> list[list[int] | VerifyError]:
    """Emitted tokens of each request from its k + 1 rows of target logits (k = its drafts, 0 or more), or
    the VerifyError that fails that request alone (the others are verified as usual). `histories` (the
    requests) give the tokens that penalties count; without them no penalty applies. `draft_probs`: each
    request's q rows (at least k) when its drafts were drawn from the drafter's distribution
    (draft_sampling.py); None, or a None entry: point masses (argmax drafts).

    Greedy requests take the argmax; sampled ones (with drafts or not) go through one batched rejection pass
    against the distributions they sample from (`sample_verdicts`). One device-to-host copy for the whole
    batch brings the argmax, whether each row's logits are finite (argmax lands on a NaN or +inf if there is
    one) and the sampled verdicts.
    """
    vocab, num_rows = logits.shape[-1], logits.shape[0]
    raw_argmax = logits.argmax(dim=-1)
    finite = torch.isfinite(logits.gather(-1, raw_argmax[:, None])[:, 0])
    processed = penalised_logits(logits, settings, histories or [None] * len(settings), drafts)
    argmax = raw_argmax if processed is logits else processed.argmax(dim=-1)
    errors = [check_drafts(request_drafts, vocab) for request_drafts in drafts]
    starts = [0]
    for request_drafts in drafts:
        starts.append(starts[-1] + len(request_drafts) + 1)
    sampled = [i for i, (s, error) in enumerate(zip(settings, errors, strict=True)) if not s.greedy and error is None]
    # A seeded request draws from its own generator; the others share the device's default one (nothing asks
    # them to replay, and their draws cost two launches in all instead of two each: random_draws).
    own = [generators[i] if settings[i].seed is not None else None for i in sampled]
    probs = draft_probs or [None] * len(settings)
    requests = [
        SampledRequest(starts[i], settings[i], g, drafts[i], probs[i]) for i, g in zip(sampled, own, strict=True)
    ]
    # Greedy requests with drafts: the one greedy rule (verifier.py) over all of them at once.
    greedy = [i for i, (s, error) in enumerate(zip(settings, errors, strict=True)) if s.greedy and error is None]
    greedy_drafts = [drafts[i] for i in greedy]
    walked: list[torch.Tensor] = []
    if any(greedy_drafts):
        verdict = verify_host_greedy(argmax, [starts[i] for i in greedy], greedy_drafts, None)
        walked = [verdict.accepted, verdict.emitted.reshape(-1)]
    host = to_host(torch.cat([argmax, finite.long(), *sample_verdicts(processed, requests), *walked]))
    tokens, finite_rows = host[:num_rows], host[num_rows : 2 * num_rows]
    found = host[2 * num_rows : 2 * num_rows + 3 * len(sampled)]
    verdicts = {i: found[3 * j : 3 * j + 3] for j, i in enumerate(sampled)}
    greedy_tokens = greedy_emitted(host[2 * num_rows + 3 * len(sampled) :], greedy, greedy_drafts)
    emitted: list[list[int] | VerifyError] = []
    for i, (setting, request_drafts, error) in enumerate(zip(settings, drafts, errors, strict=True)):
        rows = slice(starts[i], starts[i + 1])
        if error is None and not all(finite_rows[rows]):
            error = VerifyError("the target's logits are not finite (inf or NaN)")
        if error is not None:
            emitted.append(error)
        elif setting.greedy:
            emitted.append(greedy_tokens.get(i) or [tokens[starts[i]]])
        else:
            num_accepted, token, valid = verdicts[i]
            if not valid:
                emitted.append(VerifyError("the target's probabilities are not a distribution (inf or NaN)"))
            else:
                emitted.append([*request_drafts[:num_accepted], token])
    return emitted


def greedy_emitted(host: list[int], requests: list[int], drafts: list[list[int]]) -> dict[int, list[int]]:
    """Each greedy request's emitted tokens, by its index, from verify_host_greedy's verdict on the host
    (accepted [G], then emitted [G, N + 1]); {} when none had drafts (each emits its root row's argmax)."""
    if not host:
        return {}
    count = len(requests)
    width = (len(host) - count) // count
    return {i: host[count + g * width : count + g * width + host[g] + 1] for g, i in enumerate(requests)}


class SampledRequest(NamedTuple):
    """A sampled request of verify_batch: its first verify row, settings, generator, drafts (k + 1 rows) and the
    distributions they were drawn from (None: point masses)."""

    start: int
    settings: SamplingSettings
    generator: torch.Generator | None
    drafts: list[int]
    draft_probs: DraftProbs | None = None

    def draft_rows(self, vocab: int, device: torch.device) -> torch.Tensor:
        """q of each draft [k, V]: its own rows (those of drafts the scheduler kept), or point masses."""
        if self.draft_probs is not None:
            return self.draft_probs.head(len(self.drafts)).dense(vocab, device)
        ids = to_device(self.drafts, torch.int64, device)[:, None]
        return DraftProbs(ids, torch.ones(ids.shape, device=device)).dense(vocab, device)


def sample_verdicts(processed: torch.Tensor, requests: list[SampledRequest]) -> list[torch.Tensor]:
    """The sampled requests' verdicts, flattened per request as (accepted, token, valid), still on the device.
    They go in passes of about ROWS_PER_PASS rows, so the probabilities and their temporaries stay small."""
    out: list[torch.Tensor] = []
    group: list[SampledRequest] = []
    group_rows = 0
    vocab, device = processed.shape[-1], processed.device
    for index, request in enumerate(requests):
        group.append(request)
        group_rows += len(request.drafts) + 1
        if group_rows < ROWS_PER_PASS and index + 1 < len(requests):
            continue
        rows = [row for r in group for row in range(r.start, r.start + len(r.drafts) + 1)]
        row_settings = [r.settings for r in group for _ in range(len(r.drafts) + 1)]
        probs = sampled_probs(processed[to_device(rows, torch.int64, device)], row_settings)
        q = None
        if any(r.draft_probs is not None for r in group):
            q = torch.cat([r.draft_rows(vocab, device) for r in group])
        verdict = rejection_sample_batch(probs, [r.drafts for r in group], q, [r.generator for r in group])
        out.append(torch.stack([verdict.num_accepted, verdict.tokens, verdict.valid.long()], dim=1).reshape(-1))
        group, group_rows = [], 0
    return out
