"""One mixed batch for the batched rejection sampler (greedy, temperatures, top-k / top-p / min-p, penalties), run
many times, and the distances of what it emitted from the exact distributions, on any device (imported as
`batched_rejection_runs`: pytest puts this folder on sys.path)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from penalty_reference import reference_logits

from executor_service.penalties import TokenCounts
from executor_service.rejection_sampler import rejection_sample_batch, verify_batch
from executor_service.sampling import SamplingSettings, make_generator, target_probs, to_host

VOCAB = 8
TRIALS = 2000

# Total variation of a request's first emitted token against its target row. Measured 0.012 to 0.020 at
# 2000 trials; a residual of p instead of max(0, p - q) gives 0.19 to 0.24 (all but the request without drafts).
BOUND = 0.05
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.6}
REWARDS = {"repetition_penalty": 0.7, "presence_penalty": -0.5, "frequency_penalty": -0.3}


@dataclass
class History:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    token_counts: TokenCounts | None = None


@dataclass
class Batch:
    logits: torch.Tensor
    settings: list[SamplingSettings]
    drafts: list[list[int]]
    histories: list[History]

    def starts(self) -> list[int]:
        return [sum(len(d) + 1 for d in self.drafts[:i]) for i in range(len(self.drafts))]

    def exact(self, request: int, row: int) -> torch.Tensor:
        """The distribution row `row` of `request` samples from: penalties as if its drafts before the row
        were emitted (written out in penalty_reference), then temperature, min-p, top-k, top-p."""
        history, settings = self.histories[request], self.settings[request]
        output = history.output_ids + self.drafts[request][:row]
        logits = self.logits[self.starts()[request] + row].cpu()
        return target_probs(reference_logits(logits, history.prompt_ids, output, settings).float(), settings)


def mixed_batch(device: torch.device, seed: int = 0) -> Batch:
    """Seven requests; each draft is its row's most likely token or a random one, so both accept and reject."""
    settings = [
        SamplingSettings(0.0),
        SamplingSettings(0.8, seed=1),
        SamplingSettings(1.3, top_p=0.85),  # unseeded
        SamplingSettings(1.0, top_k=4, min_p=0.05, seed=3),
        SamplingSettings(0.9, seed=4, **PENALTIES),
        SamplingSettings(0.7, seed=5),
        SamplingSettings(1.1, top_p=0.9, **REWARDS),  # unseeded
    ]
    lengths = [2, 2, 3, 1, 2, 0, 3]
    histories = [History([1, 2], [2, 5]) for _ in settings]
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(lengths) + len(lengths), VOCAB, generator=generator) * 1.5
    drafts, row = [], 0
    for length in lengths:
        picks = torch.randint(VOCAB, (length,), generator=generator).tolist()
        drafts.append([p if j % 2 else int(logits[row + j].argmax()) for j, p in enumerate(picks)])
        row += length + 1
    return Batch(logits.to(device), settings, drafts, histories)


def run_batch(batch: Batch, generators: list[torch.Generator | None], trials: int) -> list[list[list[int]]]:
    """Each request's emitted tokens in each of `trials` verify_batch calls (its generator running on)."""
    emitted: list[list[list[int]]] = [[] for _ in batch.settings]
    for _ in range(trials):
        for request, tokens in enumerate(verify_batch(batch.logits, batch.settings, generators, batch.drafts,
                                                      histories=batch.histories)):  # fmt: skip
            assert isinstance(tokens, list), tokens
            emitted[request].append(tokens)
    return emitted


def first_token_distances(batch: Batch, emitted: list[list[list[int]]]) -> list[float]:
    """Per sampled request, the total variation of its first emitted token against its row 0."""
    distances = []
    for request, settings in enumerate(batch.settings):
        if settings.greedy:
            continue
        counts = torch.bincount(torch.tensor([t[0] for t in emitted[request]]), minlength=VOCAB)
        distances.append(0.5 * float((counts / counts.sum() - batch.exact(request, 0)).abs().sum()))
    return distances


def mixed_distances(device: torch.device) -> tuple[list[float], Batch, list[list[list[int]]]]:
    random.seed(0)  # the unseeded requests' generators (make_generator) draw their seeds from `random`
    torch.manual_seed(0)  # verify_batch draws for unseeded requests from the default generator
    batch = mixed_batch(device)
    emitted = run_batch(batch, [make_generator(s, device) for s in batch.settings], TRIALS)
    return first_token_distances(batch, emitted), batch, emitted


def alone_and_together(device: torch.device) -> list[tuple[list[list[int]], list[list[int]]]]:
    """The seeded sampled requests' tokens over 20 verify_batch calls, each alone and inside the mixed batch."""
    batch = mixed_batch(device, seed=1)
    together = run_batch(batch, [make_generator(s, device) for s in batch.settings], 20)
    starts, found = batch.starts(), []
    for request in (1, 3, 4, 5):
        rows = slice(starts[request], starts[request] + len(batch.drafts[request]) + 1)
        alone_batch = Batch(batch.logits[rows], [batch.settings[request]], [batch.drafts[request]],
                            [History([1, 2], [2, 5])])  # fmt: skip
        found.append(
            (run_batch(alone_batch, [make_generator(batch.settings[request], device)], 20)[0], together[request])
        )
    return found


def counting(calls: list[int], function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, noting each call in `calls`."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def drafter_distances(device: torch.device) -> list[float]:
    """Sampled drafts (q not a point mass), 1, 0 and 3 drafts per request in one rejection_sample_batch: the
    total variation of each request's first emitted token against its target row 0."""
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 0, 3]
    target = torch.softmax(2 * torch.randn(sum(lengths) + len(lengths), VOCAB, generator=generator), dim=-1)
    proposal = torch.softmax(2 * torch.randn(sum(lengths), VOCAB, generator=generator), dim=-1)
    draws = [make_generator(SamplingSettings(1.0, seed=s), device) for s in range(len(lengths))]
    counts = torch.zeros(len(lengths), VOCAB)
    for _ in range(TRIALS):
        flat = torch.multinomial(proposal, 1, generator=generator)[:, 0].tolist()  # draft i from q_i
        drafts = [flat[: lengths[0]], [], flat[lengths[0] :]]
        verdict = rejection_sample_batch(target.to(device), drafts, proposal.to(device), draws)
        accepted, tokens, valid = to_host(torch.stack([verdict.num_accepted, verdict.tokens, verdict.valid.long()]))
        assert all(valid)
        for request, request_drafts in enumerate(drafts):
            counts[request, request_drafts[0] if accepted[request] else tokens[request]] += 1
    firsts = [0, lengths[0] + 1, lengths[0] + 2]  # each request's row 0
    return [0.5 * float((counts[r] / TRIALS - target[row]).abs().sum()) for r, row in enumerate(firsts)]
