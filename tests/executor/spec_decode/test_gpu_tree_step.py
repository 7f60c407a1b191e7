"""Tree drafting on CUDA (bf16, TRITON_ATTN): the device-resident tree step replays its CUDA graphs (counted), and
its greedy output equals the target-only output of the same backend for static and dynamic trees, EAGLE,
EAGLE-3 and DFlash; with the right tokens on the trees' last branches (the accepted path's K/V moved inside the
graph) too, and graph replays give what eager steps give. The target-only reference never drafts: only tree
sessions must verify drafts (a failure prints the session's backends, step and pass counts, and every request's
Finish)."""

from __future__ import annotations

import pytest
import torch
from engine_driving import Collector, add_all
from executor_builders import greedy, tiny_session
from tree_cases import TREES, ReplayOnLastBranch, prompts, tree_session

from executor_service.server.session import ModelSession
from kernels import unavailable_reason
from specdec.v1 import common_pb2

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BF16 = common_pb2.DTYPE_BFLOAT16
BACKEND = "TRITON_ATTN"
MAX_TOKENS = 20


def cuda_tree_session(method: str, shape: str, cuda_graphs: bool = True) -> ModelSession:
    tree, k = TREES[shape]
    session = tree_session(
        method, tree, k, backend=BACKEND, num_kv_blocks=256, max_num_batched_tokens=512, device="cuda", dtype=BF16,
        cuda_graphs=cuda_graphs,
    )  # fmt: skip
    tree_step = session.engine.spec_step
    assert tree_step is not None and bool(tree_step.graphs) == cuda_graphs
    tree_step.counts.clear()  # the warm-up's steps
    return session


def diagnostics(session: ModelSession, sink: Collector) -> str:
    """What a failure needs to tell a session that never drafted from one that drafted wrong."""
    engine, proposer = session.engine, session.proposer
    lines = [
        f"backends: target {engine.runner.backend}, drafter {getattr(proposer, 'backend', None)}",
        f"tree step counts: {dict(getattr(getattr(engine, 'tree_step', None), 'counts', {}))}",
        f"drafter pass counts: {dict(getattr(proposer, 'pass_counts', {}))}",
    ]
    lines += [f"{rid}: {outputs[-1].finish if outputs else None}" for rid, outputs in sorted(sink.outputs.items())]
    return "\n".join(lines)


def run(session: ModelSession, batch: dict[str, list[int]], drafting: bool = True) -> dict[str, list[int]]:
    """Greedy tokens per request; `drafting`: a tree session, whose every request must verify drafts (the
    target-only reference has none to verify)."""
    sink = Collector()
    add_all(session, batch, greedy(MAX_TOKENS), sink)
    session.engine.run_until_idle()
    for rid in batch:
        assert all(o.error is None for o in sink.outputs[rid]), [o.error for o in sink.outputs[rid]]
        finish = sink.outputs[rid][-1].finish
        assert finish is not None, diagnostics(session, sink)
        assert (finish.verify_steps > 0 and finish.drafted_tokens > 0) == drafting, diagnostics(session, sink)
    assert session.kv_cache.allocator.num_used == 0
    return {rid: sink.tokens(rid) for rid in batch}


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    reason = unavailable_reason(BACKEND, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{BACKEND}: {reason}")
    target = tiny_session(backend=BACKEND, device="cuda", num_kv_blocks=256, max_num_seqs=16, dtype=BF16)
    return run(target, prompts(8, seed=21), drafting=False)


@pytest.mark.parametrize("replayed", [False, True], ids=["drafted", "last_branch"])
@pytest.mark.parametrize("shape", ["static_2_2_1", "dynamic_3_budget_8_depth_4"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_graph_tree_step_equals_target_only(expected: dict, method: str, shape: str, replayed: bool) -> None:
    session = cuda_tree_session(method, shape)
    if replayed:
        replay = ReplayOnLastBranch(expected)
        session.proposer.replay_tree = replay
    assert run(session, prompts(8, seed=21)) == expected
    counts = session.engine.spec_step.counts
    assert counts["graph"] > 0 and counts["eager"] == 0 and counts["eager following"] == 0
    assert (counts["graph following"] > 0) == (not replayed)  # scripted trees need the host: no step launched ahead
    if replayed:
        assert replay.accepted_path_moved > 0


@pytest.mark.parametrize("shape", ["static_2_2_1", "dynamic_3_budget_8_depth_4"])
def test_graph_replays_give_what_eager_steps_give(expected: dict, shape: str) -> None:
    """Batch sizes 1, 2, 4 (graph buckets): the same trees drafted and the same tokens with graphs and without."""
    found = {}
    for graphs in (True, False):
        session = cuda_tree_session("eagle3", shape, cuda_graphs=graphs)
        drafted: list[tuple[str, int, list[int], list[int]]] = []
        original = session.proposer.set_tree

        def record(request, tokens, parents, probs=None, original=original, drafted=drafted) -> None:
            drafted.append((request.request_id, len(request.output_ids), list(tokens), list(parents)))
            original(request, tokens, parents, probs)

        session.proposer.set_tree = record
        found[graphs] = ({size: run(session, prompts(size, seed=size)) for size in (1, 2, 4)}, drafted)
        assert session.engine.spec_step.counts["graph" if graphs else "eager"] > 0
    assert found[True] == found[False]


@pytest.mark.parametrize("shape", ["static_2_2_1", "dynamic_3_budget_8_depth_4"])
def test_shared_rotary_lookup_drafts_the_same_trees(shape: str) -> None:
    """The drafter's tree passes take cos and sin from one lookup per step (a static pass at batch 1: a stride-0
    view into it, read by the fused rotary kernel): eagerly on CUDA, batches 1 and 2, the trees and tokens are
    the ones drafted when every pass looks up its own positions."""
    found = []
    for own_lookup in (False, True):
        session = cuda_tree_session("eagle3", shape, cuda_graphs=False)
        drafter, drafted = session.proposer.drafter, []
        if own_lookup:
            forward = drafter.forward
            drafter.forward = lambda *args, rotary=None, forward=forward: forward(*args)
        original = session.proposer.set_tree

        def record(request, tokens, parents, probs=None, original=original, drafted=drafted) -> None:
            drafted.append((request.request_id, len(request.output_ids), list(tokens), list(parents)))
            original(request, tokens, parents, probs)

        session.proposer.set_tree = record
        found.append(({size: run(session, prompts(size, seed=size)) for size in (1, 2)}, drafted))
        assert session.engine.spec_step.counts["eager"] > 0
    assert len(found[0][1]) > 4 and found[0] == found[1]
