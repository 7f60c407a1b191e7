"""One mixed batch for the host path's verifier (host_verify.verify_on_host: greedy, temperatures, top-k / top-p /
min-p, penalties, logprobs, 0 to 3 drafts), run many times, and the distances of what it emitted from the exact
distributions, on any device (imported as `host_verify_runs`: pytest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from penalty_reference import reference_logits

from executor_service.engine.request import Request
from executor_service.sample.sampling import DraftProbs, SamplingSettings, target_probs
from executor_service.spec_decode.host_verify import TreeVerdict, VerifyError, verify_on_host

VOCAB = 8
TRIALS = 2000
PROMPT, OUTPUT = [1, 2], [2, 5]  # every request's history (what penalties count)

# Total variation of a request's first emitted token against its target row. Measured 0.012 to 0.020 at
# 2000 trials; a residual of p instead of max(0, p - q) gives 0.19 to 0.24 (all but the request without drafts).
BOUND = 0.05
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.6}
REWARDS = {"repetition_penalty": 0.7, "presence_penalty": -0.5, "frequency_penalty": -0.3}
SETTINGS = [
    SamplingSettings(0.0),
    SamplingSettings(0.8, seed=1),
    SamplingSettings(1.3, top_p=0.85, logprobs=2),  # unseeded
    SamplingSettings(1.0, top_k=4, min_p=0.05, seed=3),
    SamplingSettings(0.9, seed=4, **PENALTIES),
    SamplingSettings(0.7, seed=5),
    SamplingSettings(1.1, top_p=0.9, **REWARDS),  # unseeded
]
LENGTHS = [2, 2, 3, 1, 2, 0, 3]


def request_of(
    settings: SamplingSettings, seed: int, name: str = "r", prompt: list[int] = PROMPT, output: list[int] = OUTPUT
) -> Request:
    """A request whose newest token is at position len(prompt + output) - 1 (the key of its draws), with `seed`
    where its settings set none."""
    return Request(name, list(prompt), settings, 8, frozenset(), lambda _: None, seed=seed, output_ids=list(output))


@dataclass
class Batch:
    logits: torch.Tensor
    settings: list[SamplingSettings]
    drafts: list[list[int]]

    def starts(self) -> list[int]:
        return [sum(len(d) + 1 for d in self.drafts[:i]) for i in range(len(self.drafts))]

    def exact(self, request: int, row: int) -> torch.Tensor:
        """The distribution row `row` of `request` samples from: penalties as if its drafts before the row
        were emitted (written out in penalty_reference), then temperature, min-p, top-k, top-p."""
        settings, output = self.settings[request], OUTPUT + self.drafts[request][:row]
        logits = self.logits[self.starts()[request] + row].cpu()
        return target_probs(reference_logits(logits, PROMPT, output, settings).float(), settings)

    def requests(self, trial: int | None) -> list[Request]:
        """Fresh requests; `trial` not None: each draws its own numbers in each trial (a seed of its own)."""
        return [
            request_of(s if trial is None else replace(s, seed=trial * len(self.settings) + i), 100 + i, f"r{i}")
            for i, s in enumerate(self.settings)
        ]

    def alone(self, request: int) -> Batch:
        rows = slice(self.starts()[request], self.starts()[request] + len(self.drafts[request]) + 1)
        return Batch(self.logits[rows], [self.settings[request]], [self.drafts[request]])


def mixed_batch(device: torch.device, seed: int = 0) -> Batch:
    """Seven requests; each draft is its row's most likely token or a random one, so both accept and reject."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(LENGTHS) + len(LENGTHS), VOCAB, generator=generator) * 1.5
    drafts, row = [], 0
    for length in LENGTHS:
        picks = torch.randint(VOCAB, (length,), generator=generator).tolist()
        drafts.append([p if j % 2 else int(logits[row + j].argmax()) for j, p in enumerate(picks)])
        row += length + 1
    return Batch(logits.to(device), list(SETTINGS), drafts)


def emitted_tokens(verdicts: list[TreeVerdict | VerifyError]) -> list[list[int]]:
    assert all(isinstance(v, TreeVerdict) for v in verdicts), verdicts
    return [v.emitted for v in verdicts if isinstance(v, TreeVerdict)]


def run_batch(batch: Batch, trials: int, fresh: bool = True) -> list[list[list[int]]]:
    """Each request's emitted tokens in each of `trials` verify_on_host calls; `fresh`: its own numbers in each."""
    emitted: list[list[list[int]]] = [[] for _ in batch.settings]
    for trial in range(trials):
        found = verify_on_host(batch.logits, batch.requests(trial if fresh else None), batch.drafts)
        for request, tokens in enumerate(emitted_tokens(found)):
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
    batch = mixed_batch(device)
    emitted = run_batch(batch, TRIALS)
    return first_token_distances(batch, emitted), batch, emitted


def alone_and_together(device: torch.device) -> list[tuple[list[int], list[int]]]:
    """The seeded sampled requests' tokens, each alone and inside the mixed batch (its own seed: the same
    numbers), and the batch's tokens in a second run."""
    batch = mixed_batch(device, seed=1)
    together = emitted_tokens(verify_on_host(batch.logits, batch.requests(None), batch.drafts))
    found = [(together, emitted_tokens(verify_on_host(batch.logits, batch.requests(None), batch.drafts)))]
    for request in (1, 3, 4, 5):
        alone = batch.alone(request)
        found.append((emitted_tokens(verify_on_host(alone.logits, alone.requests(None), alone.drafts))[0],
                      together[request]))  # fmt: skip
    return found


def counting(calls: list[int], function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, noting each call in `calls`."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def full_support(q: torch.Tensor) -> DraftProbs:
    """q rows [k, V] as DraftProbs on every id."""
    return DraftProbs(torch.arange(q.shape[-1], device=q.device).expand(q.shape), q)


def drafter_distances(device: torch.device, trials: int = TRIALS) -> list[float]:
    """Drafts drawn from q (not a point mass), 1, 0 and 3 drafts per request in one verify_on_host call: the
    total variation of each request's first emitted token against its target row 0."""
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 0, 3]
    target = torch.softmax(2 * torch.randn(sum(lengths) + len(lengths), VOCAB, generator=generator), dim=-1)
    proposal = torch.softmax(2 * torch.randn(sum(lengths), VOCAB, generator=generator), dim=-1)
    probs = [full_support(proposal[:1].to(device)), None, full_support(proposal[1:].to(device))]
    settings = SamplingSettings(1.0)
    counts = torch.zeros(len(lengths), VOCAB)
    for trial in range(trials):
        flat = torch.multinomial(proposal, 1, generator=generator)[:, 0].tolist()  # draft i from q_i
        drafts = [flat[: lengths[0]], [], flat[lengths[0] :]]
        requests = [request_of(replace(settings, seed=3 * trial + i), 0) for i in range(3)]
        for request, tokens in enumerate(
            emitted_tokens(verify_on_host(target.log().to(device), requests, drafts, probs))
        ):
            counts[request, tokens[0]] += 1
    firsts = [0, lengths[0] + 1, lengths[0] + 2]  # each request's row 0
    return [0.5 * float((counts[r] / trials - target[row]).abs().sum()) for r, row in enumerate(firsts)]
