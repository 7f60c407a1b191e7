"""Penalties (and a logit bias) and logprobs with tree drafting, on the device tree step and the host path: greedy
requests give the penalised reference token for token while the accepted paths run off the first branch (a row
that did not count the drafts on its path, or counted its siblings', would pick another token), logprobs are the
target's raw log-softmax along the accepted path, and a batch mixing greedy, sampled, penalised and logprob
requests stays on the device step (the host path verifies no tree), through the graph buffers too (chains and
trees); the extras step's op count is guarded."""

from __future__ import annotations

from typing import Any

import pytest
from engine_driving import Collector
from greedy_reference import greedy_reference
from penalty_cases import BIASED_PENALISED, PENALISED, PENALISED_WITH_LOGPROBS, WITH_LOGPROBS, check_logprobs
from penalty_reference import greedy_penalised
from spec_builders import spec_session
from tree_cases import TREES, ReplayOnLastBranch, prompts, tree_session, use_device_step

from executor_service.runner import cuda_graphs
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession

MAX_TOKENS = 10
SAMPLED = SamplingSettings(temperature=0.9, top_p=0.9, seed=3, repetition_penalty=1.2, logprobs=2)
GREEDY = SamplingSettings()


def expected(session: ModelSession, prompt: list[int], settings: SamplingSettings) -> list[int]:
    if settings.has_penalties:
        return greedy_penalised(session.loaded.model, prompt, MAX_TOKENS, settings)
    return greedy_reference(session.loaded.model, prompt, MAX_TOKENS)


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("shape", ["static_2_2_1", "dynamic_3_budget_8_depth_4"])
def test_penalised_trees_equal_the_penalised_reference(shape: str, on_device: bool) -> None:
    tree, k = TREES[shape]
    session = tree_session("eagle3", tree, k)
    use_device_step(session, on_device)
    kinds = [PENALISED, GREEDY, WITH_LOGPROBS, PENALISED_WITH_LOGPROBS, BIASED_PENALISED]
    batch = {rid: (prompt, kinds[i % 5]) for i, (rid, prompt) in enumerate(prompts(5, seed=11, longest=12).items())}
    references = {rid: expected(session, prompt, s) for rid, (prompt, s) in batch.items()}
    plain = {rid: greedy_reference(session.loaded.model, p, MAX_TOKENS) for rid, (p, _) in batch.items()}
    assert any(references[rid] != plain[rid] for rid, (_, s) in batch.items() if s.has_penalties)  # they bite
    replay = ReplayOnLastBranch(references)
    session.proposer.replay_tree = replay
    sink = Collector()
    for rid, (prompt, settings) in batch.items():
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    assert replay.accepted_path_moved > 0
    for rid, (prompt, settings) in batch.items():
        assert sink.tokens(rid) == references[rid], rid
        assert sink.outputs[rid][-1].finish.accepted_tokens > 0
        if settings.logprobs is not None:
            check_logprobs(session, sink, rid, prompt, settings.logprobs)
    if on_device:
        assert session.engine.spec_step.counts["extras"] > 0 and not session.engine.step_counts["host drafts"]
    else:
        assert session.engine.step_counts["host drafts"] > 0
    assert session.kv_cache.allocator.num_used == 0


def test_a_batch_mixing_every_kind_stays_on_the_device_step() -> None:
    """Greedy, sampled, penalised and logprob requests (and one that is all of them) in one batch: every tree is
    verified on the device step (its extras variant; steps launched ahead of the read-back too), and each
    greedy request keeps its reference."""
    tree, k = TREES["dynamic_3_budget_8_depth_4"]
    session = tree_session("eagle3", tree, k)
    use_device_step(session, True)
    kinds = [GREEDY, SamplingSettings(temperature=0.7, top_k=50), PENALISED, WITH_LOGPROBS, SAMPLED]
    batch = {rid: (prompt, kinds[i]) for i, (rid, prompt) in enumerate(prompts(5, seed=2, longest=12).items())}
    sink = Collector()
    for rid, (prompt, settings) in batch.items():
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    counts = session.engine.spec_step.counts
    host = session.engine.step_counts["host drafts"]
    assert counts["extras sorted"] > 0 and counts["eager following"] > 0 and not host, (counts, host)
    assert counts["greedy"] == counts["sampled"] == counts["sorted"] == counts["extras"] == 0
    for rid, (prompt, settings) in batch.items():
        assert len(sink.tokens(rid)) == MAX_TOKENS and sink.outputs[rid][-1].finish.verify_steps > 0
        if settings.greedy:
            assert sink.tokens(rid) == expected(session, prompt, settings), rid
        if settings.logprobs is not None:
            check_logprobs(session, sink, rid, prompt, settings.logprobs)
        else:
            assert all(o.logprobs is None for o in sink.outputs[rid])
    assert not session.engine.spec_step.table.assigned  # every slot given back


MIXED = [
    GREEDY,
    SamplingSettings(temperature=0.7, top_p=0.9, seed=5),
    SamplingSettings(repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingSettings(logprobs=4),
    SAMPLED,
]


def session_and_step(shape: str) -> tuple[ModelSession, Any]:
    """An EAGLE-3 session of `shape` ("chain" or a TREES name) and its device step."""
    if shape == "chain":
        session = spec_session("eagle3", 3, max_num_batched_tokens=64)
        return session, session.engine.spec_step
    tree, k = TREES[shape]
    session = tree_session("eagle3", tree, k)
    return session, session.engine.spec_step


def mixed_run(shape: str, graph_batch: int) -> tuple[ModelSession, Collector, dict[str, list[int]]]:
    """The MIXED batch, on the device step eagerly or through its graph buffers (StepGraphs reruns the forward
    from its static buffers on the CPU: padded requests hold slot -1 and penalties 0)."""
    session, step = session_and_step(shape)
    if graph_batch:
        step.capture_graphs(graph_batch, session.engine.max_model_len)
    step.counts.clear()
    batch = prompts(len(MIXED), seed=8, longest=10)
    sink = Collector()
    for (rid, prompt), settings in zip(batch.items(), MIXED, strict=True):
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    return session, sink, batch


@pytest.mark.skipif(not hasattr(cuda_graphs, "EagerReplay"), reason="step graphs replay on CUDA only here")
@pytest.mark.parametrize("shape", ["chain", "static_2_2_1"])
def test_graph_buffers_of_the_extras_variant(shape: str) -> None:
    """Five requests in the bucket of eight (three padded: they count nothing and move nothing), steps launched
    ahead through the same buffers: the same tokens and logprobs as the eager device step."""
    session, sink, batch = mixed_run(shape, graph_batch=8)
    step = session.engine.spec_step
    counts = step.counts
    assert counts["extras sorted"] > 0 and counts["graph"] > 0 and counts["graph following"] > 0, counts
    assert counts["eager"] == counts["eager following"] == 0 and not step.table.assigned
    assert step.table.output is not None and not step.table.output[-1].any()  # the scratch slot stays zero
    _, eager, _ = mixed_run(shape, graph_batch=0)
    for rid in batch:
        assert sink.tokens(rid) == eager.tokens(rid), rid
        assert [o.logprobs for o in sink.outputs[rid]] == [o.logprobs for o in eager.outputs[rid]]
    assert sink.outputs["r3"][-1].logprobs is not None


@pytest.mark.parametrize(
    ("shape", "name", "most"),
    [
        ("chain", "greedy", 202),
        ("chain", "sampled", 321),
        ("chain", "extras", 550),
        ("static_2_2_1", "sampled", 354),
        ("static_2_2_1", "extras", 593),
    ],
)
def test_a_warm_step_keeps_its_op_count(shape: str, name: str, most: int) -> None:
    """The step's own ops at batch 1 (the target's pass left out, views not counted; +4 of slack for other torch
    versions, as test_tree_step's guard): 2026-12 chain greedy 198 (unchanged by the extras variants), chain
    extras 495 (sampled 447), static_2_2_1 extras 539 (sampled 489; greedy 228: test_tree_step). Penalised
    drafting (draft_penalties.py) adds to the extras variants alone: 3 ops to gather the slots' counts, 12 per
    pick to penalise the drafter's logits and 1 to count a chain's pick: chain extras 537, static_2_2_1 578. The
    logit bias (2026-11-28): its rows built once a step from the slots (PenaltyTable.bias_rows) and added to the
    verify rows, gathered for the drafter's vocabulary and added at each pick: chain extras 544, static_2_2_1 587.
    Sampled point-mass drafts verified by each row's own draw (2026-11-29; verifier.py): chain sampled 445 -> 317,
    static_2_2_1 489 -> 350 (a sampled request; the extras requests here are greedy and penalised)."""
    from op_counting import OpCounter, count_each_call

    mode = OpCounter(lambda func: not func.is_view)
    session, step = session_and_step(shape)
    session.engine.runner.forward = mode.paused(session.engine.runner.forward)
    counts = count_each_call(mode, step)
    settings = {"greedy": GREEDY, "sampled": SamplingSettings(0.8, seed=1)}.get(
        name, SamplingSettings(repetition_penalty=1.3)
    )
    sink = Collector()
    session.engine.add(session.new_request("a", [3, 4, 5, 6], settings, 8, sink))
    session.engine.run_until_idle()
    assert step.counts[name] > 0
    assert len(counts) >= 3 and max(counts[1:]) <= most, counts
