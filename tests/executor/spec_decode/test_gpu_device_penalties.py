"""Penalties and logprobs on the device step on CUDA with graphs (the extras variants, device_penalties.py), as
test_gpu_sampled_step.py checks the sampled ones: a batch of 16 mixing 8 greedy, 4 sampled (top-p 0.9 / top-k 50),
2 penalised and 2 logprob requests replays the extras graph for every verify step (the host path verifies no
draft), and gives the same tokens and logprobs with graphs off; a seeded penalised request emits the same tokens
alone, in that batch and without graphs; penalised greedy requests give the penalised reference."""

from __future__ import annotations

import random

import pytest
import torch
from engine_driving import Collector
from gpu_sampled_cases import session_of, step_of
from greedy_reference import dense_logits
from penalty_reference import greedy_penalised

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MAX_TOKENS = 30
SEEDED = SamplingSettings(temperature=0.8, top_p=0.9, seed=99, repetition_penalty=1.3, logprobs=3)
KINDS = (
    [SamplingSettings()] * 8
    + [SamplingSettings(temperature=0.7, top_p=0.9, seed=10 + i) for i in range(2)]
    + [SamplingSettings(temperature=0.7, top_k=50, seed=20 + i) for i in range(2)]
    + [SamplingSettings(repetition_penalty=1.3), SamplingSettings(temperature=0.7, repetition_penalty=1.2, seed=30)]
    + [SamplingSettings(logprobs=5), SamplingSettings(temperature=0.7, logprobs=5, seed=40)]
)


def generate(session: ModelSession, kinds: list[SamplingSettings]) -> tuple[dict[str, list[int]], Collector]:
    rng, sink = random.Random(7), Collector()
    prompts = {}
    for i, settings in enumerate(kinds):
        prompts[f"r{i}"] = [rng.randrange(500) for _ in range(12)]
        session.engine.add(session.new_request(f"r{i}", prompts[f"r{i}"], settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    for outputs in sink.outputs.values():
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert session.kv_cache.allocator.num_used == 0
    return prompts, sink


def logprobs_of(sink: Collector, rid: str) -> list[tuple[int, float, tuple]]:
    return [(t.token_id, t.logprob, t.top) for o in sink.outputs[rid] for t in o.logprobs or []]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_mixed_batch_of_16_replays_the_extras_graph(shape: str) -> None:
    session = session_of(shape)
    counts = step_of(session).counts
    counts.clear()  # the warm-up's steps (greedy, eager)
    session.engine.step_counts.clear()
    prompts, sink = generate(session, KINDS)
    assert counts["extras sorted"] > 0 and counts["graph"] > 0 and counts["graph following"] > 0, counts
    assert counts["eager"] == 0 and counts["eager following"] == 0, counts
    assert not session.engine.step_counts["host drafts"], session.engine.step_counts
    eager_session = session_of(shape, cuda_graphs=False)
    _, eager = generate(eager_session, KINDS)
    assert step_of(eager_session).counts["eager"] > 0
    model = session.loaded.model
    for i, settings in enumerate(KINDS):
        rid = f"r{i}"
        assert sink.tokens(rid) == eager.tokens(rid), rid
        if settings.greedy and settings.has_penalties:
            assert sink.tokens(rid) == greedy_penalised(model, prompts[rid], MAX_TOKENS, settings)
        if settings.logprobs is None:
            continue
        found, without_graphs = logprobs_of(sink, rid), logprobs_of(eager, rid)
        assert [t for t, _, _ in found] == sink.tokens(rid)
        assert [v for _, v, _ in found] == pytest.approx([v for _, v, _ in without_graphs], abs=1e-5)
        dense = torch.log_softmax(dense_logits(model, prompts[rid] + sink.tokens(rid)).float(), dim=-1)
        rows = dense[len(prompts[rid]) - 1 : -1]
        expected = rows.gather(1, torch.tensor(sink.tokens(rid), device=rows.device)[:, None])[:, 0]
        assert [v for _, v, _ in found] == pytest.approx(expected.tolist(), abs=1e-3)
        assert all(len(top) == settings.logprobs for _, _, top in found)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_seeded_penalised_request_draws_the_same_alone_in_a_batch_and_without_graphs(shape: str) -> None:
    session = session_of(shape)
    _, alone = generate(session, [SEEDED])
    _, together = generate(session, [SEEDED, *KINDS[:15]])
    assert step_of(session).counts["extras sorted"] > 0
    eager_session = session_of(shape, cuda_graphs=False)
    _, eager = generate(eager_session, [SEEDED, *KINDS[4:9]])
    assert alone.tokens("r0") == together.tokens("r0") == eager.tokens("r0")
    assert together.outputs["r0"][-1].finish.verify_steps > 0
    found = [logprobs_of(s, "r0") for s in (alone, together, eager)]
    for other in found[1:]:
        assert [v for _, v, _ in other] == pytest.approx([v for _, v, _ in found[0]], abs=1e-4)
