"""The host path's verification: a step's requests with their drafts (chains, trees, or none), verified by the one
verifier (verifier.verify) in one pass, with one device-to-host copy.

Each request's rows are penalised as if the drafts on its path had been emitted (penalties.penalised_logits).
Its random numbers are counter-based, keyed by its seed and its root's position (the newest token's, where the
device steps key them too), so a seeded request draws the same numbers alone or in any batch, here or on the
device step. A faulty drafter's id outside the vocabulary, or logits that are not finite, fail that request
alone: a `VerifyError` in its place, the others verified as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_service.engine.request import Request
from executor_service.models.fused_ops import checked_argmax
from executor_service.sample.device_sampling import SamplingTensors, StepKeys
from executor_service.sample.penalties import penalised_logits
from executor_service.sample.sampling import DraftProbs, host_sort, to_host
from executor_service.spec_decode.verifier import DraftQ, Verdict, host_layout, verify


class VerifyError(RuntimeError):
    """One request's verification failed (drafts outside the vocabulary, logits that are not finite)."""


# The errors of a request's rows that are not sound (also the overlapped decode step's: engine/overlap_decode.py).
NOT_FINITE = "the target's logits are not finite (inf or NaN)"
NOT_A_DISTRIBUTION = "the target's probabilities are not a distribution (inf or NaN)"


def check_drafts(draft_tokens: list[int], vocab_size: int) -> VerifyError | None:
    """An error if a draft id is outside [0, vocab_size): a faulty drafter. Host lists, so no device work."""
    if draft_tokens and (min(draft_tokens) < 0 or max(draft_tokens) >= vocab_size):
        bad = [t for t in draft_tokens if not 0 <= t < vocab_size][:4]
        return VerifyError(f"the drafter proposed ids outside the vocabulary [0, {vocab_size}): {bad}")
    return None


@dataclass(frozen=True)
class DraftTree:
    """One request's drafts in topological order and each one's parent (-1: the root)."""

    tokens: list[int]
    parents: list[int]

    def children(self) -> list[list[int]]:
        """Children of the root (index 0) and of each draft j (index j + 1), in draft order."""
        found: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for j, parent in enumerate(self.parents):
            found[parent + 1].append(j)
        return found

    def depths(self) -> list[int]:
        """Each draft's depth below the root (1: a child of the root)."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(depth[parent] + 1 if parent >= 0 else 1)
        return depth


@dataclass(frozen=True)
class TreeVerdict:
    """A request's verdict (a chain is a tree): the accepted drafts, root's child first, and the emitted tokens
    (their tokens, then the target's next token)."""

    path: list[int]
    emitted: list[int]


Drafts = list[int] | DraftTree  # a chain's drafts, or a tree


def verify_on_host(
    logits: torch.Tensor,
    requests: Sequence[Request],
    drafts: Sequence[Drafts],
    draft_probs: Sequence[DraftProbs | None] | None = None,
) -> list[TreeVerdict | VerifyError]:
    """Each request's verdict from its rows of logits (its drafts + 1, request after request), or the VerifyError
    that fails it alone. `draft_probs`: a chain's q (None, or a None entry: point masses)."""
    if not requests:
        return []
    vocab = logits.shape[-1]
    tokens = [d.tokens if isinstance(d, DraftTree) else d for d in drafts]
    trees = [d.parents if isinstance(d, DraftTree) else None for d in drafts]
    errors = [check_drafts(t, vocab) for t in tokens]
    starts = [0]
    for request_tokens in tokens:
        starts.append(starts[-1] + len(request_tokens) + 1)
    settings = [r.settings for r in requests]
    processed = penalised_logits(logits, settings, requests, tokens, trees)
    finite = checked_argmax(logits)[1]  # no NaN or +inf, not all -inf
    kept = [[] if e is not None else t for t, e in zip(tokens, errors, strict=True)]  # a bad request: its root
    verdict = _verify_batch(processed, requests, kept, trees, starts, draft_probs)
    valid = verdict.valid if verdict.valid is not None else torch.ones_like(verdict.accepted, dtype=torch.bool)
    per_request = torch.cat([valid[:, None].long(), verdict.accepted[:, None], verdict.path_rows, verdict.emitted], 1)
    host = to_host(torch.cat([finite.long(), per_request.reshape(-1)]))
    return _verdicts(host, starts, errors)


def _verify_batch(
    logits: torch.Tensor,
    requests: Sequence[Request],
    tokens: list[list[int]],
    trees: list[list[int] | None],
    starts: list[int],
    draft_probs: Sequence[DraftProbs | None] | None,
) -> Verdict:
    """verifier.verify over the batch, padded to its longest drafts (a request without drafts: a 1-row tree);
    request i's rows start at starts[i]."""
    chain = all(t is None or not d for t, d in zip(trees, tokens, strict=True))
    as_trees = [list(range(-1, len(d) - 1)) if p is None else p[: len(d)] for p, d in zip(trees, tokens, strict=True)]
    parents = None if chain else as_trees
    layout, rows = host_layout(starts[:-1], tokens, parents, logits.device)
    width = layout.tokens.shape[1] + 1
    if starts != list(range(0, width * len(tokens) + 1, width)):  # uneven: each one's rows, padded with its last
        logits = logits[rows.reshape(-1)]
    settings, device = [r.settings for r in requests], logits.device
    q = None
    if draft_probs is not None and any(p is not None for p in draft_probs) and layout.tokens.shape[1]:
        q = DraftQ.build(layout.tokens, draft_probs)
    sampling = keys = None
    if not all(s.greedy for s in settings):
        seeds, roots = [r.seed for r in requests], [r.num_tokens - 1 for r in requests]  # each root's position
        sampling = SamplingTensors.build(settings, seeds, device)
        keys = StepKeys.on_host(seeds, roots, device, layout.depth, q_drafts=q is not None)
    return verify(logits, layout, sampling, keys, host_sort(settings, logits.shape[-1]), q=q, check=True)


def _verdicts(host: list[int], starts: list[int], errors: list[VerifyError | None]) -> list[TreeVerdict | VerifyError]:
    """Each request's verdict from the host copy: whether each row is finite [R], then per request: whether its
    last token came from a distribution, drafts accepted, path rows [D + 1] and emitted tokens [D + 1]."""
    count, num_rows = len(errors), starts[-1]
    finite, width = host[:num_rows], (len(host) - num_rows) // count
    found: list[TreeVerdict | VerifyError] = []
    for i, error in enumerate(errors):
        valid, accepted, *rest = host[num_rows + i * width : num_rows + (i + 1) * width]
        if error is None and not all(finite[starts[i] : starts[i + 1]]):
            error = VerifyError(NOT_FINITE)
        elif error is None and not valid:
            error = VerifyError(NOT_A_DISTRIBUTION)
        if error is not None:
            found.append(error)
            continue
        path_rows, emitted = rest[: len(rest) // 2], rest[len(rest) // 2 :]
        found.append(TreeVerdict([row - 1 for row in path_rows[1 : accepted + 1]], emitted[: accepted + 1]))
    return found
