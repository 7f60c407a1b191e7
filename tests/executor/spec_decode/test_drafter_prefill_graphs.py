"""The drafter's lone-request context-pass graphs (Proposer.capture_prefill_graphs, runner/prefill_graphs.py) on the
CPU's stand-in graphs, which replay from the same static buffers and padding as CUDA graphs do: every context pass
that goes through a bucket (a prompt's, a prompt chunk's, a held context's flush) gives the eager pass's outputs on
the same inputs and writes the drafter's cache exactly as it does, padding rows nowhere; generations through them
are the target's own tokens."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from drafter_prefill_cases import checked_session, generate, generate_together
from engine_driving import Collector
from executor_builders import greedy
from greedy_reference import greedy_reference
from spec_builders import Scripted, spec_session
from tree_cases import TREES

from executor_service.models.attention_step import AttentionStep
from executor_service.runner.cuda_graphs import GRAPH_BACKENDS
from executor_service.runner.prefill_graphs import PrefillGraphs, VarlenGraphs
from executor_service.server import session as session_module
from executor_service.server.session import EngineSettings, capture_graphs
from executor_service.spec_decode.proposer import Proposer


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize(("length", "bucket"), [(5, 16), (16, 16), (17, 32), (40, 64), (64, 64)])
def test_a_lone_prompts_context_pass_through_its_bucket_is_the_eager_one(method: str, length: int, bucket: int) -> None:
    session, buckets = checked_session(method)
    prompt = [(7 * i + 3) % 200 for i in range(length)]
    assert generate(session, prompt, 6) == greedy_reference(session.loaded.model, prompt, 6)
    assert buckets and buckets[0] == bucket, buckets


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_chunks_and_flushed_held_rows_go_through_the_buckets(method: str) -> None:
    """A 70-token prompt in chunks of at most 32 rows (the later ones over the cached ones), then steps without
    drafting whose held rows flush at the switch back to drafting (deferred_context.py), and the host path's
    verify steps: every context pass of the lone request goes through a bucket, checked."""
    session, buckets = checked_session(method, max_rows=32)
    session.engine.speculation = Scripted([0, 0, 0, 3, 0, 3], [0, 3])
    prompt = [(11 * i + 5) % 200 for i in range(70)]
    assert generate(session, prompt, 16) == greedy_reference(session.loaded.model, prompt, 16)
    counts = session.proposer.pass_counts if session.proposer is not None else {}
    name = f"{method.removesuffix('3')}_context"
    assert buckets[:3] == [32, 32, 16] and len(buckets) >= 5, buckets  # the chunks, then flushes and verify steps
    assert counts[f"{name} prefill graph"] == len(buckets) and counts[f"{name} eager"] == 0, counts


@pytest.mark.parametrize(
    ("method", "shape"),
    [
        ("eagle3", "static_2_2_1"),
        ("eagle3", "dynamic_3_budget_8_depth_4"),
        ("dflash", "static_3_2"),
        ("dflash", "dynamic_2_budget_5_depth_3"),
    ],
)
def test_a_trees_lone_context_passes_through_the_buckets_are_the_eager_ones(method: str, shape: str) -> None:
    """Trees' proposals on the host path (a prompt's; a verify step's accepted path, the CPU's host path): a lone
    request's context pass through its bucket, checked against the eager one; tokens the target's own."""
    session, buckets = checked_session(method, tree=TREES[shape])
    prompt = [(5 * i + 2) % 200 for i in range(23)]
    assert generate(session, prompt, 8) == greedy_reference(session.loaded.model, prompt, 8)
    counts = session.proposer.pass_counts if session.proposer is not None else {}
    assert buckets[0] == 32 and counts["tree_context prefill graph"] == len(buckets), (buckets, counts)
    assert counts["tree_context eager"] == 0, counts


def test_the_check_sees_padding_rows_that_hide_a_real_rows_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a replay whose sequence length leaves the padding rows out (each real row then sees keys past its
    own place, or fewer) fails the comparison with the eager pass."""

    def uncounted(self: PrefillGraphs, rows: int, positions: torch.Tensor, step: AttentionStep, **inputs):
        return self.graphs[rows].run(step.block_table, step.seq_lens, step.slot_mapping, positions, **inputs)

    monkeypatch.setattr(PrefillGraphs, "run", uncounted)
    for tree in (None, TREES["static_2_2_1"]):
        session, _ = checked_session("eagle3", tree=tree)
        with pytest.raises(AssertionError, match="not close"):
            generate(session, list(range(3, 12)), 4)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_several_requests_context_passes_through_the_batch_buckets(method: str) -> None:
    """Three prompts prefilled in one step (one context pass over their 43 rows), then steps without drafting whose
    held rows flush for all three at once (deferred_context.py): each pass through a batch bucket, checked against
    the eager pass over the same inputs and cache; the tokens are the target's own."""
    session, buckets = checked_session(method, batched=True)
    session.engine.speculation = Scripted([0, 0, 0, 3, 0, 3], [0, 3])
    prompts = {f"r{i}": [(11 * i + 5 * j) % 200 for j in range(n)] for i, n in enumerate((9, 20, 14))}
    outputs = generate_together(session, prompts, 12)
    for rid, prompt in prompts.items():
        assert outputs[rid] == greedy_reference(session.loaded.model, prompt, 12), rid
    counts = session.proposer.pass_counts if session.proposer is not None else {}
    name = f"{method.removesuffix('3')}_context"
    assert buckets[0] == 64 and counts[f"{name} batch prefill graph"] >= 2, (buckets, counts)
    assert counts[f"{name} eager"] == 0, counts


@pytest.mark.parametrize(("method", "shape"), [("eagle3", "static_2_2_1"), ("dflash", "static_3_2")])
def test_several_requests_tree_context_passes_through_the_batch_buckets(method: str, shape: str) -> None:
    """Trees: three prompts' context pass in one step (the host path's `_tree_context`) through a batch bucket,
    checked against the eager pass; the target's tokens."""
    session, buckets = checked_session(method, tree=TREES[shape], batched=True)
    prompts = {f"r{i}": [(7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate((5, 17, 11))}
    outputs = generate_together(session, prompts, 8)
    for rid, prompt in prompts.items():
        assert outputs[rid] == greedy_reference(session.loaded.model, prompt, 8), rid
    counts = session.proposer.pass_counts if session.proposer is not None else {}
    assert buckets == [64] and counts["tree_context batch prefill graph"] == 1, (buckets, counts)
    assert counts["tree_context eager"] == 0, counts


def test_the_check_sees_a_batch_replay_that_drops_its_rows_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: a batch replay that leaves its rows' positions out (RoPE at the wrong places) fails the comparison
    with the eager pass."""
    original = VarlenGraphs.run_rows

    def unplaced(self: VarlenGraphs, step: AttentionStep, positions: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        return original(self, step, torch.zeros_like(positions), *args, **kwargs)

    monkeypatch.setattr(VarlenGraphs, "run_rows", unplaced)
    session, _ = checked_session("eagle3", batched=True)
    with pytest.raises(AssertionError, match="not close"):
        generate_together(session, {"a": list(range(3, 12)), "b": list(range(40, 60))}, 4)


def test_a_loads_prefill_graphs_stop_at_the_models_length() -> None:
    """With a step budget past the model's length (2,048 rows, 512 positions), the load's prefill graphs, the
    target's and the drafter's, lone and batch, stop at the model's length (prefill_graph_rows): a capture runs one
    request over all its rows."""
    session = spec_session("eagle3", 3, max_num_batched_tokens=2048)
    max_model_len = 512
    with (
        mock.patch.object(session_module, "GRAPH_BACKENDS", GRAPH_BACKENDS | {"CPU_ATTN"}),
        mock.patch.object(session_module, "BATCH_PREFILL_BACKENDS", {"CPU_ATTN"}),
    ):
        capture_graphs(session, EngineSettings(2048, 16, True), max_model_len)
    runner, proposer = session.engine.runner, session.proposer
    assert proposer is not None and proposer.prefill_graphs is not None and proposer.batch_prefill_graphs is not None
    assert runner.prefill_graphs is not None and runner.batch_prefill_graphs is not None
    lone_and_batch = (runner.prefill_graphs, runner.batch_prefill_graphs, proposer.prefill_graphs)
    for graphs in (*lone_and_batch, proposer.batch_prefill_graphs):
        assert max(graphs.graphs) <= max_model_len < 2 * max(graphs.graphs), sorted(graphs.graphs)


def test_only_the_context_pass_of_one_request_takes_a_bucket() -> None:
    session = spec_session("eagle3", 3)
    proposer = session.proposer
    assert isinstance(proposer, Proposer) and proposer.prefill_graphs is None  # CPU_ATTN: nothing captured at load
    proposer.capture_prefill_graphs(64)
    assert proposer.prefill_graphs is not None and sorted(proposer.prefill_graphs.graphs) == [16, 32, 64]
    batch = {f"r{i}": [(5 * i + j) % 200 for j in range(9)] for i in range(3)}
    sink = Collector()
    for rid, prompt in batch.items():
        session.engine.add(session.new_request(rid, prompt, greedy(), 4, sink))
    session.engine.run_until_idle()
    counts = proposer.pass_counts
    assert counts["eagle_context prefill graph"] == 0 and counts["eagle_context eager"] > 0, counts
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, 4), rid


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_load_captures_the_drafters_prefill_graphs(method: str) -> None:
    """The session's capture (as on CUDA: CPU_ATTN let in, the CPU's stand-in graphs) takes the drafter's context
    pass graphs, a lone request's and several requests', beside the target's prefill graphs, and a lone prompt's
    proposal replays them."""
    session = spec_session(method, 3, max_num_batched_tokens=64)
    with (
        mock.patch.object(session_module, "GRAPH_BACKENDS", GRAPH_BACKENDS | {"CPU_ATTN"}),
        mock.patch.object(session_module, "BATCH_PREFILL_BACKENDS", {"CPU_ATTN"}),
    ):
        capture_graphs(session, EngineSettings(64, 16, True), session.limits.max_model_len)
    proposer = session.proposer
    assert proposer is not None and proposer.prefill_graphs is not None
    assert sorted(proposer.prefill_graphs.graphs) == [16, 32, 64] and session.engine.runner.prefill_graphs is not None
    assert proposer.batch_prefill_graphs is not None and sorted(proposer.batch_prefill_graphs.graphs) == [16, 32, 64]
    prompt = [(3 * i + 1) % 200 for i in range(21)]
    assert generate(session, prompt, 5) == greedy_reference(session.loaded.model, prompt, 5)
    name = f"{method.removesuffix('3')}_context"
    assert proposer.pass_counts[f"{name} prefill graph"] == 1, proposer.pass_counts
