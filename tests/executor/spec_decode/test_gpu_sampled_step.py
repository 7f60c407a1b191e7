"""Sampled requests on the device step, on CUDA with graphs: chains and trees replay the sampled variants' graphs,
and a seeded request emits the same tokens alone, in a batch mixing greedy and sampled requests, and with graphs
off (its draws are keyed by its seed and positions, not by the batch or the replay)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_driving import Collector
from executor_builders import tiny_session
from following_cases import MIXED, logprobs, serve_finishing_apart
from gpu_sampled_cases import BACKEND, FP32, session_of, step_of

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SEEDED = SamplingSettings(temperature=0.8, top_p=0.9, seed=1234)
OTHERS = [
    SamplingSettings(),
    SamplingSettings(temperature=0.7),
    SamplingSettings(temperature=1.0, top_k=20, min_p=0.02),
]


def generate(session: ModelSession, companions: int) -> tuple[list[int], Collector]:
    """The seeded request's tokens, run beside `companions` other requests (greedy and sampled, unseeded)."""
    rng, sink = random.Random(5), Collector()
    prompt = [rng.randrange(500) for _ in range(12)]
    session.engine.add(session.new_request("seeded", prompt, SEEDED, 40, sink))
    for i in range(companions):
        other = [rng.randrange(500) for _ in range(12)]
        session.engine.add(session.new_request(f"o{i}", other, OTHERS[i % len(OTHERS)], 40, sink))
    session.engine.run_until_idle()
    for outputs in sink.outputs.values():
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return sink.tokens("seeded"), sink


@pytest.mark.parametrize("shape", ["chain", "tree", "chain drawn"])
def test_a_seeded_request_draws_the_same_alone_in_a_batch_and_without_graphs(shape: str) -> None:
    session = session_of(shape)
    alone, _ = generate(session, 0)
    together, sink = generate(session, 7)
    counts = step_of(session).counts
    assert counts["graph"] > 0 and counts["sorted"] > 0  # the batch's top-p / top-k: the sorted variant
    assert sink.outputs["seeded"][-1].finish.verify_steps > 0
    eager_session = session_of(shape, cuda_graphs=False)
    eager, _ = generate(eager_session, 3)
    assert step_of(eager_session).counts["eager"] > 0
    assert alone == together == eager


@pytest.mark.parametrize("shape", ["chain", "chain drawn"])
def test_sampled_only_batches_replay_the_sampled_graph(shape: str) -> None:
    session = session_of(shape)
    counts = step_of(session).counts
    counts.clear()  # the warm-up's steps (greedy, eager)
    sink = Collector()
    for i in range(4):
        settings = SamplingSettings(temperature=0.7, seed=i)
        session.engine.add(session.new_request(f"s{i}", [i + 1, 7, 9], settings, 30, sink))
    session.engine.run_until_idle()
    assert counts["sampled"] > 0 and counts["graph"] > 0 and counts["eager"] == 0 and counts["eager following"] == 0
    assert all(len(sink.tokens(f"s{i}")) == 30 for i in range(4))
    assert session.engine.step_counts["host drafts"] == 0  # every verify step on the device, drawn drafts too
    step = step_of(session)
    assert len({graphs.pool for graphs in step.graphs.values()}) == 1  # the variants share one memory pool


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_seeded_request_emits_target_only_decoding_s_tokens(shape: str) -> None:
    """Point-mass drafts, graphs replayed: each row's draw is keyed by its position, as a decode step's, so the
    seeded request's tokens are those of a target-only session (fp32, the same synthetic target)."""
    with_drafter, sink = generate(session_of(shape), 3)
    assert sink.outputs["seeded"][-1].finish.verify_steps > 0
    target_only = tiny_session(BACKEND, num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=16,
                               device="cuda", dtype=FP32)  # fmt: skip
    alone, _ = generate(target_only, 3)
    assert with_drafter == alone


@pytest.mark.parametrize("shape", ["chain", "tree", "chain drawn"])
def test_a_finish_keeps_the_chain_of_graph_replays(shape: str) -> None:
    """Requests mixing greedy, sampled, penalised and logprob requests, finishing apart, on CUDA with graphs: the
    step after a finish replays for those still running (a smaller bucket), launched from the device, and every
    token, logprob and acceptance count is a run's that launches afresh after each finish (test_spec_following.py's
    CPU test, here with graph replays and the device's own kernels)."""
    narrowed, control = session_of(shape), session_of(shape)
    step_of(narrowed).counts.clear()  # the warm-up's steps (eager, before the graphs were captured)
    outputs, fresh = serve_finishing_apart(narrowed, narrow=True)
    expected, control_fresh = serve_finishing_apart(control, narrow=False)
    for rid in outputs.by_id:
        assert outputs.tokens(rid) == expected.tokens(rid), rid
        assert logprobs(outputs, rid) == logprobs(expected, rid), rid
    assert outputs.acceptance() == expected.acceptance()
    counts = step_of(narrowed).counts
    assert counts["graph following"] > 0 and counts["eager following"] == 0, counts
    assert counts["narrowed"] == control_fresh - fresh > 0, counts  # where the control launched afresh
    assert fresh <= 2 and control_fresh - fresh == len(MIXED) - 1, (fresh, control_fresh)
