"""Sampling stays lossless when requests of one batch draft different numbers of tokens: the same check as
test_spec_sampling (seeded requests on a 6-token vocabulary against the dense target's exact marginals, a
total-variation bound that a wrong verification fails), with each request's num_speculative_tokens one of
0, 1, 2 and 3 (the drafter's k), so every step verifies uneven drafts and plain rows side by side."""

from __future__ import annotations

import torch
from engine_driving import Collector
from spec_sampling_runs import (
    BATCH,
    BOUND,
    MAX_TOKENS,
    PROMPT,
    REQUESTS,
    SETTINGS,
    VOCAB,
    exact_marginals,
    total_variations,
)
from spec_sampling_runs import session as session  # the module-scoped fixture, shared

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

K = 3


def test_mixed_k_sampling_keeps_the_target_distribution(session: ModelSession) -> None:
    settings = SETTINGS["temperature"]
    exact = exact_marginals(session.loaded.model, settings)
    sink, counts = Collector(), torch.zeros(MAX_TOKENS, VOCAB, dtype=torch.float64)
    drafted = [0] * (K + 1)
    for start in range(0, REQUESTS, BATCH):
        for seed in range(start, start + BATCH):
            seeded = SamplingSettings(**{**settings.__dict__, "seed": seed})
            session.engine.add(session.new_request(f"s{seed}", PROMPT, seeded, MAX_TOKENS, sink, seed % (K + 1)))
        session.engine.run_until_idle()
    accepted = 0
    for seed in range(REQUESTS):
        tokens, finish = sink.tokens(f"s{seed}"), sink.outputs[f"s{seed}"][-1].finish
        assert len(tokens) == MAX_TOKENS and finish is not None
        assert len(finish.acceptance_per_position) <= seed % (K + 1)
        counts[torch.arange(MAX_TOKENS), torch.tensor(tokens)] += 1
        drafted[seed % (K + 1)] += finish.drafted_tokens
        accepted += finish.accepted_tokens
    assert drafted[0] == 0 and all(d > REQUESTS // 10 for d in drafted[1:])
    assert REQUESTS // 20 < accepted < sum(drafted)
    distances = total_variations(counts / REQUESTS, exact)
    assert max(distances) < BOUND, distances
    assert session.kv_cache.allocator.num_used == 0
