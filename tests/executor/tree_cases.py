"""Tree drafting cases: the trees tested, a session drafting them, a drafter that replays the target's tokens on one
branch, and the check that greedy tree output equals target-only output (imported as `tree_cases`: pytest puts this
folder on sys.path)."""

from __future__ import annotations

import random

import torch
from engine_driving import Collector, add_all
from executor_builders import greedy, load_request
from greedy_reference import greedy_reference
from spec_builders import draft_model

from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, ModelSession, build_session
from executor_service.server.wire import resolve_target
from executor_service.spec_decode.host_verify import DraftTree
from executor_service.spec_decode.spec_step import SpecStep
from specdec.v1 import common_pb2

VOCAB = 512
TREES = {
    "static_2_2_1": (common_pb2.DraftTree(branching=[2, 2, 1]), 0),
    "static_3_2": (common_pb2.DraftTree(branching=[3, 2]), 0),
    "static_1_1_1_1": (common_pb2.DraftTree(branching=[1, 1, 1, 1]), 0),  # a chain as a tree
    "dynamic_3_budget_8_depth_4": (common_pb2.DraftTree(top_k=3, verify_budget=8), 4),
    "dynamic_2_budget_5_depth_3": (common_pb2.DraftTree(top_k=2, verify_budget=5), 3),
}


def tree_session(
    method: str,
    tree: common_pb2.DraftTree,
    k: int = 0,
    backend: str = "CPU_ATTN",
    vocab_size: int = VOCAB,
    draft_seed: int = 7,
    num_kv_blocks: int = 96,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    device: str = "cpu",
    dtype: int = common_pb2.DTYPE_FLOAT32,
    cuda_graphs: bool = True,
    adaptive: bool = False,
) -> ModelSession:
    request = load_request(backend=backend, num_kv_blocks=num_kv_blocks)
    request.target.synthetic.vocab_size = vocab_size
    request.dtype = dtype
    # DFlash: a block of 8, room for every tree here (its depth is at most the block size - 1).
    request.draft.CopyFrom(draft_model(method, 7 if method == "dflash" else k or 3, draft_seed, vocab_size))
    request.draft.num_speculative_tokens = k
    request.draft.tree.CopyFrom(tree)
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None)
    decision = common_pb2.BackendDecision(backend=backend)
    settings = EngineSettings(max_num_batched_tokens, max_num_seqs, cuda_graphs, adaptive_speculation=adaptive)
    return build_session(
        source, request, decision, torch.device(device), settings, start=False, draft=draft, draft_decision=decision
    )


def prompts(count: int, seed: int, longest: int = 30) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(1, longest))] for i in range(count)}


class ReplayOnLastBranch:
    """Rewrites each drafted tree: the target's own continuation along the last child at every depth, a wrong
    token everywhere else, so the accepted path is never the tree's first nodes."""

    def __init__(self, references: dict[str, list[int]]) -> None:
        self.references = references
        self.accepted_path_moved = 0

    def __call__(self, request, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
        done = len(request.output_ids)
        upcoming = self.references[request.request_id][done:]
        children = DraftTree(tokens, parents).children()
        rewritten = [(upcoming[0] + 1) % VOCAB if upcoming else 0] * len(tokens)
        node, depth = -1, 0
        while children[node + 1] and depth < len(upcoming):
            for child in children[node + 1]:
                rewritten[child] = (upcoming[depth] + 1) % VOCAB
            node = children[node + 1][-1]
            rewritten[node] = upcoming[depth]
            self.accepted_path_moved += node != depth
            depth += 1
        return rewritten, parents


def check_equals_target_only(session: ModelSession, max_tokens: int, batch: dict[str, list[int]]) -> Collector:
    sink = Collector()
    add_all(session, batch, greedy(max_tokens), sink)
    session.engine.run_until_idle()
    for rid, prompt in batch.items():
        assert sink.tokens(rid) == greedy_reference(session.loaded.model, prompt, max_tokens), rid
        finish = sink.outputs[rid][-1].finish
        assert finish is not None and finish.reason == "length" and finish.verify_steps > 0
        assert finish.drafted_tokens == sum(o.num_drafted for o in sink.outputs[rid])
        assert finish.accepted_tokens == sum(o.num_accepted for o in sink.outputs[rid])
    assert session.kv_cache.allocator.num_used == 0 and not session.engine.scheduler.has_work()
    assert not session.proposer.parents
    return sink


def use_device_step(session: ModelSession, on_device: bool) -> None:
    """The device-resident tree step (spec_step.py), or the host path alone."""
    assert isinstance(session.engine.spec_step, SpecStep) and session.engine.spec_step.tree is not None
    session.engine.spec_step.counts.clear()  # the session's warm-up ran greedy trees
    session.engine.step_counts.clear()
    if not on_device:
        session.engine.spec_step = None
