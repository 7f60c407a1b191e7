"""Batch prefill graphs (runner/prefill_graphs.py) as a session captures them (the CPU's stand-in graphs, CPU_ATTN let
in): steps of several requests without drafts (prompts arriving together, an arrival beside decodes, a prompt's
chunks beside others) replay them, and every request's tokens are the target's own, target-only and with a drafter
(whose steps with drafts stay off them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
from engine_driving import Collector
from executor_builders import greedy, tiny_session
from greedy_reference import greedy_reference
from spec_builders import spec_session

from executor_service.runner.cuda_graphs import GRAPH_BACKENDS
from executor_service.runner.prefill_graphs import BATCH_PREFILL_BACKENDS
from executor_service.server import session as session_module
from executor_service.server.session import EngineSettings, ModelSession, capture_graphs


@contextmanager
def cpu_graphs() -> Iterator[None]:
    """CPU_ATTN let into the graph backends: the CPU's stand-in graphs."""
    with (
        mock.patch.object(session_module, "GRAPH_BACKENDS", GRAPH_BACKENDS | {"CPU_ATTN"}),
        mock.patch.object(session_module, "BATCH_PREFILL_BACKENDS", BATCH_PREFILL_BACKENDS | {"CPU_ATTN"}),
    ):
        yield


def captured(session: ModelSession, max_batched: int, max_seqs: int) -> ModelSession:
    """The session's graphs, batch prefill graphs on by default (CPU_ATTN skips requests of no rows, as TRITON_ATTN
    does)."""
    settings = EngineSettings(max_batched, max_seqs, True)
    with cpu_graphs():
        capture_graphs(session, settings, session.limits.max_model_len)
    session.engine.runner.step_counts.clear()  # the load's warm-up ran before the graphs were captured
    return session


def serve_arrivals(session: ModelSession, max_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """Two prompts together, a few steps, then two more beside their decodes (one longer than the step budget, in
    chunks): (tokens, greedy reference) per request."""
    engine, sink = session.engine, Collector()
    prompts = {f"r{i}": [(11 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate([9, 20, 5, 70])}
    for rid in ("r0", "r1"):
        engine.add(session.new_request(rid, prompts[rid], greedy(), max_tokens, sink))
    engine._drain_commands()
    for _ in range(3):
        engine.step()
    for rid in ("r2", "r3"):
        engine.add(session.new_request(rid, prompts[rid], greedy(), max_tokens, sink))
    engine.run_until_idle()
    model = session.loaded.model
    return {rid: (sink.tokens(rid), greedy_reference(model, prompt, max_tokens)) for rid, prompt in prompts.items()}


def test_target_only_arrivals_beside_decodes_replay_batch_prefill_graphs() -> None:
    session = captured(tiny_session(max_num_batched_tokens=64, max_num_seqs=8), 64, 8)
    runner = session.engine.runner
    assert runner.batch_prefill_graphs is not None and sorted(runner.batch_prefill_graphs.graphs) == [16, 32, 64]
    for rid, (tokens, reference) in serve_arrivals(session, 10).items():
        assert tokens == reference, rid
    counts = runner.step_counts
    # the first two prompts (29 rows); the arrivals beside two decodes (64: 5 and 57 of 70), then 13 rows beside 3
    assert counts["batch prefill graph"] == 3 and counts["eager"] == 0 and counts["graph"] > 0, counts


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_with_a_drafter_prefills_together_replay_them_and_verify_steps_do_not(method: str) -> None:
    session = captured(spec_session(method, 3, max_num_batched_tokens=64, max_num_seqs=8), 64, 8)
    for rid, (tokens, reference) in serve_arrivals(session, 10).items():
        assert tokens == reference, rid
    counts, spec_step = session.engine.runner.step_counts, session.engine.spec_step
    assert counts["batch prefill graph"] == 2, counts  # the first two prompts, then the two arrivals
    assert spec_step is not None and spec_step.counts.total() > 0, spec_step.counts  # verify steps: the device step's


def test_switched_off_nothing_is_captured() -> None:
    session = tiny_session(max_num_batched_tokens=48, max_num_seqs=8)
    with cpu_graphs():
        capture_graphs(session, EngineSettings(48, 8, True, batch_prefill_graphs=False), session.limits.max_model_len)
    assert session.engine.runner.batch_prefill_graphs is None and session.engine.runner.prefill_graphs is not None
