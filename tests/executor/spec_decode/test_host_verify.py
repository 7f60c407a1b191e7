"""The host path's verification (host_verify.verify_on_host) on one mixed batch: greedy and sampled requests,
temperatures, top-k, top-p, min-p, penalties, logprobs, 0 to 3 drafts, drafts drawn from q or point masses, all
verified by the one verifier in one pass. Each request's emitted tokens follow its own target distribution (a
broken acceptance is caught), a seeded request gives the same tokens alone, in the batch and run to run, and on the
host path and the device step alike, and the whole batch costs one host copy."""

from __future__ import annotations

import random

import pytest
import torch
from engine_driving import Collector
from host_verify_runs import (
    BOUND,
    PENALTIES,
    REWARDS,
    TRIALS,
    VOCAB,
    alone_and_together,
    counting,
    drafter_distances,
    mixed_batch,
    mixed_distances,
    request_of,
    run_batch,
)
from op_counting import OpCounter
from spec_builders import spec_session
from tree_cases import TREES, tree_session
from verify_reference import accepts_all

import executor_service.engine.host_step as host_step
import executor_service.spec_decode.host_verify as host_verify
import executor_service.spec_decode.verifier as verifier
from executor_service.sample.sampling import SamplingSettings, to_host
from executor_service.server.session import ModelSession
from executor_service.spec_decode.host_verify import verify_on_host

CPU = torch.device("cpu")


def test_a_mixed_batch_keeps_every_target_distribution() -> None:
    distances, batch, emitted = mixed_distances(CPU)
    assert max(distances) < BOUND, distances
    assert all(tokens == emitted[0][0] for tokens in emitted[0])  # greedy: the same every time
    # The second token, given the first draft was accepted, follows row 1 (penalised as if draft 0 was emitted).
    for request in (1, 4, 6):
        seconds = [t[1] for t in emitted[request] if len(t) > 1]
        assert len(seconds) > TRIALS // 5, (request, len(seconds))  # both paths ran, many times
        assert len(seconds) < TRIALS * 0.9, (request, len(seconds))
        counts = torch.bincount(torch.tensor(seconds), minlength=VOCAB)
        distance = 0.5 * float((counts / counts.sum() - batch.exact(request, 1)).abs().sum())
        assert distance < 2 * BOUND, (request, distance)  # fewer samples than the first token's


def drafts_not_emitted(broken: object | None, monkeypatch: pytest.MonkeyPatch) -> int:
    """Over 200 runs of the mixed batch (their own numbers), how often an accepted draft is not the token emitted
    in its place, with verifier._greedy_hits replaced by `broken` (None: as it is)."""
    if broken is not None:
        monkeypatch.setattr(verifier, "_greedy_hits", broken)
    batch = mixed_batch(CPU)
    emitted = run_batch(batch, 200)
    return sum(tokens[:-1] != batch.drafts[r][: len(tokens) - 1] for r, runs in enumerate(emitted) for tokens in runs)


def test_accepted_drafts_are_the_tokens_emitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled draft is accepted when it is the token its row draws (so the token emitted in its place): a rule
    that accepts whatever the draw (the negative control) emits other tokens where drafts were accepted, and the
    target's later rows would read a text that was not emitted."""
    assert drafts_not_emitted(None, monkeypatch) == 0
    assert drafts_not_emitted(accepts_all, monkeypatch) > 50


def test_a_seeded_request_gives_the_same_tokens_alone_in_the_batch_and_run_to_run() -> None:
    for first, second in alone_and_together(CPU):
        assert first == second


def test_the_whole_batch_costs_one_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(host_verify, "to_host", counting(calls, to_host))
    run_batch(mixed_batch(CPU), 3)
    assert len(calls) == 3, calls  # one per verify_on_host call


def test_drafts_drawn_from_q_in_one_batch() -> None:
    distances = drafter_distances(CPU)
    assert max(distances) < BOUND, distances


def test_an_engine_step_of_sampled_requests_verifies_with_one_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine (EAGLE, k = 3, drafts drawn from q): a batch of sampled requests with their own k (0 to
    3), penalties, min-p, top-k and top-p, seeded and not, makes one host copy in each verification."""
    session = spec_session("eagle", 3, vocab_size=64)
    assert session.proposer is not None
    session.proposer.sample_drafts = True
    copies: list[int] = []
    verified: list[int] = []
    monkeypatch.setattr(host_verify, "to_host", counting(copies, to_host))
    monkeypatch.setattr(host_step, "verify_on_host", counting(verified, host_verify.verify_on_host))
    sink = Collector()
    settings = [
        SamplingSettings(0.8, seed=1, ignore_eos=True),
        SamplingSettings(1.2, top_p=0.9, top_k=10, ignore_eos=True),
        SamplingSettings(0.9, min_p=0.05, seed=3, ignore_eos=True, **PENALTIES),
        SamplingSettings(1.0, ignore_eos=True, **REWARDS),
    ]
    for i, setting in enumerate(settings * 2):
        session.engine.add(session.new_request(f"r{i}", [3, 1, 4, 1, 5], setting, 12, sink, i % 4))
    session.engine.run_until_idle()
    assert all(len(sink.tokens(f"r{i}")) == 12 for i in range(8))
    assert len(verified) > 3 and len(copies) == len(verified), (len(copies), len(verified))


SEEDED = [
    SamplingSettings(0.8, seed=11, ignore_eos=True),
    SamplingSettings(1.1, top_p=0.9, min_p=0.02, seed=12, ignore_eos=True),
    SamplingSettings(0.9, seed=13, ignore_eos=True, logprobs=2),
    SamplingSettings(),
]


def session_of(shape: str) -> ModelSession:
    if shape == "chain":
        return spec_session("eagle3", 3)
    tree, k = TREES["static_2_2_1"]
    return tree_session("eagle3", tree, k)


def seeded_tokens(shape: str, on_device: bool, drawn: bool = False) -> dict[str, list[int]]:
    """Each request's tokens, the device step on or off, with argmax drafts or (`drawn`) drafts drawn from q on
    both paths."""
    session = session_of(shape)
    step = session.engine.spec_step
    assert step is not None and session.proposer is not None
    session.proposer.sample_drafts = drawn
    step.counts.clear()
    if not on_device:
        session.engine.spec_step = None
    rng, sink = random.Random(3), Collector()
    for i, settings in enumerate(SEEDED):
        prompt = [rng.randrange(VOCAB_OF_SESSIONS) for _ in range(rng.randint(3, 9))]
        session.engine.add(session.new_request(f"r{i}", prompt, settings, 16, sink))
    session.engine.run_until_idle()
    assert (step.counts["eager"] > 0) is on_device, step.counts
    assert all(o.error is None for outputs in sink.outputs.values() for o in outputs)
    return {f"r{i}": sink.tokens(f"r{i}") for i in range(len(SEEDED))}


VOCAB_OF_SESSIONS = 500


@pytest.mark.parametrize(("shape", "drawn"), [("chain", False), ("tree", False), ("chain", True)])
def test_seeded_requests_emit_the_same_tokens_on_the_host_path_and_the_device_step(
    shape: str, drawn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same seeded requests (with a greedy one beside them) on the CPU-eager device step and on the host path:
    the same numbers, keyed by seed and root position, so the same tokens. Drafts drawn from q too: the host's
    sampler and the device step's draws key each draft by seed and position and draw from the same q."""
    calls: list[int] = []
    monkeypatch.setattr(verifier, "_q_hits", counting(calls, verifier._q_hits))
    on_device = seeded_tokens(shape, on_device=True, drawn=drawn)
    assert on_device == seeded_tokens(shape, on_device=False, drawn=drawn)
    assert all(len(tokens) == 16 for tokens in on_device.values())
    if drawn:  # the q rule ran (argmax drafts are verified by each row's draw instead)
        assert calls, "no draft drawn from q was verified"


@pytest.mark.parametrize(("settings", "most"), [(SamplingSettings(0.0), 22), (SamplingSettings(0.7, seed=3), 80)])
def test_a_step_without_drafts_verifies_in_few_ops(settings: SamplingSettings, most: int) -> None:
    """Target-only decode on the host path (its sampled requests too) costs a few dozen launches: each one is
    several microseconds of a GPU step. Measured 2026-11-28: greedy 18, sampled 72 (336 before the random
    numbers' keys were computed on the host and drafts-free steps skipped the drafts' rule), + slack."""
    mode = OpCounter(lambda func: not func.is_view)
    requests = [request_of(settings, 5 + i, f"r{i}") for i in range(4)]
    logits = torch.randn(4, 1000)
    verify_on_host(logits, requests, [[]] * 4)
    with mode:
        verify_on_host(logits, requests, [[]] * 4)
    assert mode.count <= most, mode.count
