"""Tree drafting on the CPU: greedy output equals target-only output token for token for static and dynamic
trees, EAGLE, EAGLE-3 and DFlash (random drafters, and a replaying one whose right tokens sit on the last branch, so the
accepted drafts' K/V must move into place); stats per depth; nothing leaks; the tree mask reaches the kernels."""

from __future__ import annotations

import pytest
import torch
from engine_driving import Collector, add_all
from executor_builders import greedy, load_request
from greedy_reference import greedy_reference
from spec_builders import draft_model
from tree_cases import TREES, ReplayOnLastBranch, check_equals_target_only, prompts, tree_session, use_device_step

import executor_service.engine.engine as engine_module
from executor_service.errors import InvalidField
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import ModelSession
from executor_service.server.wire import resolve_target, status_error
from executor_service.spec_decode.spec_step import SpecStep
from specdec.v1 import common_pb2
from specdec_runtime.errors import InvalidArgument


def check_path_taken(session: ModelSession, on_device: bool) -> None:
    if on_device:
        assert session.engine.spec_step.counts["eager"] > 0


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_greedy_tree_equals_target_only(method: str, shape: str, on_device: bool) -> None:
    tree, k = TREES[shape]
    session = tree_session(method, tree, k)
    assert isinstance(session.engine.spec_step, SpecStep) and session.engine.spec_step.tree is not None
    use_device_step(session, on_device)
    check_equals_target_only(session, 10, prompts(4, seed=len(shape)))
    check_path_taken(session, on_device)


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("shape", ["static_2_2_1", "dynamic_3_budget_8_depth_4"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_accepted_paths_off_the_first_branch(method: str, shape: str, on_device: bool) -> None:
    """Every verify step accepts the whole depth along the last branch: the output is still the target's, the
    accepted K/V was moved into place (a wrong cache entry would change the next tokens), stats per depth are 1."""
    tree, k = TREES[shape]
    session = tree_session(method, tree, k)
    use_device_step(session, on_device)
    batch = prompts(3, seed=5)
    references = {rid: greedy_reference(session.loaded.model, p, 16) for rid, p in batch.items()}
    replay = ReplayOnLastBranch(references)
    session.proposer.replay_tree = replay
    sink = check_equals_target_only(session, 16, batch)
    assert replay.accepted_path_moved > 0
    check_path_taken(session, on_device)
    shape = session.proposer.tree
    for rid in batch:
        finish = sink.outputs[rid][-1].finish
        # A static tree holds the whole depth along its last branch; a dynamic one only where it expanded it.
        # The last steps run short of wanted tokens.
        reach = shape.depth - 1 if not shape.dynamic else 1
        assert finish.accepted_tokens >= (finish.verify_steps - 1) * reach
        assert finish.acceptance_per_position[0] == 1.0
        # A dynamic tree keeps its best-scored nodes: a random DFlash's flat marginals keep it shallower.
        depths = len(finish.acceptance_per_position)
        assert depths == shape.depth or (method == "dflash" and shape.dynamic and 1 < depths < shape.depth)


@pytest.mark.parametrize("backend", ["FLEX_ATTENTION", "TRITON_ATTN"])
def test_tree_steps_on_the_other_tree_backends(backend: str) -> None:
    from kernels import unavailable_reason

    if unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip(unavailable_reason(backend, torch.device("cpu")))
    tree, k = TREES["dynamic_2_budget_5_depth_3"]
    session = tree_session("eagle3", tree, k, backend=backend)
    batch = prompts(2, seed=3, longest=12)
    references = {rid: greedy_reference(session.loaded.model, p, 6) for rid, p in batch.items()}
    session.proposer.replay_tree = ReplayOnLastBranch(references)
    check_equals_target_only(session, 6, batch)


def test_a_causal_verify_pass_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree mask matters: verifying the tree with a causal mask (siblings and cousins visible) changes the
    accepted drafts' K/V and the target's rows, and the output leaves the target's."""
    tree, _ = TREES["static_3_2"]
    session = tree_session("eagle3", tree)
    use_device_step(session, False)  # the host path's inputs are patched here (test_tree_step.py: the device's)
    batch = prompts(3, seed=9)
    references = {rid: greedy_reference(session.loaded.model, p, 12) for rid, p in batch.items()}
    session.proposer.replay_tree = ReplayOnLastBranch(references)
    original = engine_module.draft_inputs

    def causal_inputs(scheduled, inputs, parents):  # type: ignore[no-untyped-def]
        trees = original(scheduled, inputs, parents)
        inputs.attention.tree_mask = None
        return trees

    monkeypatch.setattr(engine_module, "draft_inputs", causal_inputs)
    sink = Collector()
    add_all(session, batch, greedy(12), sink)
    session.engine.run_until_idle()
    assert any(sink.tokens(rid) != references[rid] for rid in batch)


@pytest.mark.parametrize(
    ("method", "tree", "k", "field"),
    [
        ("dflash", common_pb2.DraftTree(branching=[2, 2, 1, 1]), 0, "draft.num_speculative_tokens"),  # block 4
        ("dflash", common_pb2.DraftTree(top_k=4, verify_budget=40), 3, "draft.tree.verify_budget"),  # 36 drafted
        ("eagle3", common_pb2.DraftTree(branching=[2, 2]), 3, "draft.num_speculative_tokens"),
        ("eagle3", common_pb2.DraftTree(top_k=4, verify_budget=64), 4, "draft.tree.verify_budget"),
        ("eagle3", common_pb2.DraftTree(top_k=2, verify_budget=1), 3, "draft.tree.verify_budget"),  # < the depth
        ("eagle", common_pb2.DraftTree(branching=[8, 8]), 0, "draft.tree.branching"),
    ],
)
def test_bad_trees_are_refused_at_load(method: str, tree: common_pb2.DraftTree, k: int, field: str) -> None:
    request = load_request()
    request.draft.CopyFrom(draft_model(method, 3))
    request.draft.num_speculative_tokens = k
    request.draft.tree.CopyFrom(tree)
    source = resolve_target(request.target, None, "target")
    with pytest.raises(InvalidField) as err:
        resolve_draft(request.draft, source.config, None)
    status = status_error(err.value)
    assert isinstance(status, InvalidArgument) and field in [v.field for v in status.field_violations]


def test_tree_config() -> None:
    tree, k = TREES["dynamic_3_budget_8_depth_4"]
    session = tree_session("eagle3", tree, k)
    config = session.proposer.config
    assert config.num_draft_tokens == 8 and config.num_steps == config.tree.depth == 4  # drafts per step; drafter steps
    assert config.positions_ahead == 9  # top_k x (depth - 1) keys of expanded nodes
    assert session.info.num_speculative_tokens == 8
    dflash = tree_session("dflash", tree, k).proposer.config  # a block of 8
    assert dflash.num_draft_tokens == 8 and dflash.num_steps == dflash.tree.depth == 4
    assert dflash.positions_ahead == 8  # the block pass writes the whole block


async def test_load_and_generate_over_grpc(stub) -> None:
    """LoadModel with a tree: the executor asks the selector for tree attention (CPU_ATTN here, both stacks) and
    streams the target's greedy tokens; a forced backend without tree attention is refused by name."""
    import grpc

    from specdec.v1 import executor_pb2

    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3))
    request.draft.num_speculative_tokens = 0
    request.draft.tree.CopyFrom(common_pb2.DraftTree(branching=[2, 2, 1]))
    response = await stub.LoadModel(request)
    assert response.target_backend.use_tree_attention and response.draft_backend.use_tree_attention
    assert response.info.num_speculative_tokens == 10
    generate = executor_pb2.GenerateRequest(request_id="t", token_ids=executor_pb2.TokenIds(ids=[5, 9, 2]))
    generate.sampling.max_tokens = 6
    tokens = [t async for message in stub.Generate(generate) for t in message.token_ids]
    assert len(tokens) == 6
    request.draft.attention_backend = "FLASH_ATTN"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tree attention not supported" in err.value.details()


async def test_a_dflash_tree_over_grpc(stub) -> None:
    """LoadModel with a DFlash tree: tree attention for the target only (R11: the drafter's block pass is the
    chain's), 16 drafts verified per step; Generate streams the target's greedy tokens; a tree deeper than the
    block is refused naming the field, and the model loaded before keeps serving."""
    import grpc

    from specdec.v1 import executor_pb2

    request = load_request()
    request.draft.CopyFrom(draft_model("dflash", 7))  # a block of 8
    request.draft.num_speculative_tokens = 7
    request.draft.tree.CopyFrom(common_pb2.DraftTree(top_k=4, verify_budget=16))
    response = await stub.LoadModel(request)
    assert response.target_backend.use_tree_attention and not response.draft_backend.use_tree_attention
    assert response.info.num_speculative_tokens == 16
    generate = executor_pb2.GenerateRequest(request_id="d", token_ids=executor_pb2.TokenIds(ids=[5, 9, 2]))
    generate.sampling.max_tokens = 8
    tokens = [t async for message in stub.Generate(generate) for t in message.token_ids]
    assert len(tokens) == 8
    request.draft.num_speculative_tokens = 8  # past the block's 7 positions
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.LoadModel(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft.num_speculative_tokens" in err.value.details()
    again = [t async for message in stub.Generate(generate) for t in message.token_ids]
    assert again == tokens  # the loaded DFlash tree still serves, greedy as before
