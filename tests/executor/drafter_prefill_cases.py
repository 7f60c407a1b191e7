"""What the drafter's context-pass prefill graphs' tests check on the CPU's stand-in graphs and on CUDA: every
context pass of a lone request that replays a bucket gives the eager pass's outputs on the same inputs and writes
the drafter's cache as it does, padding rows nowhere."""

from __future__ import annotations

from collections.abc import Callable

import torch
from engine_driving import Collector
from executor_builders import greedy
from prefill_graph_cases import SENTINEL  # every cache slot before a run: one still holding it was not written
from spec_builders import spec_session
from tree_cases import tree_session

from executor_service.models.attention_step import AttentionStep
from executor_service.server.session import ModelSession
from specdec.v1 import common_pb2


def checked_session(
    method: str, max_rows: int = 64, device: str = "cpu", dtype: int = common_pb2.DTYPE_FLOAT32, atol: float = 1e-5,
    tree: tuple[common_pb2.DraftTree, int] | None = None,
) -> tuple[ModelSession, list[int]]:  # fmt: skip
    """A session whose drafter (a chain, or `tree`: tree_cases.TREES' (tree, k)) has context-pass prefill graphs
    (captured at load on CUDA, here on the CPU), every context pass through them checked against the eager pass over
    the same inputs and cache, within `atol` (the list returned collects each checked pass's bucket)."""
    backend = "TRITON_ATTN" if device == "cuda" else "CPU_ATTN"
    if tree is None:
        session = spec_session(method, 3, backend, max_num_batched_tokens=max_rows, device=device, dtype=dtype)
    else:
        shape, k = tree
        session = tree_session(method, shape, k, backend, max_num_batched_tokens=max_rows, device=device, dtype=dtype)
    proposer = session.proposer
    assert proposer is not None
    if device == "cuda":
        assert proposer.prefill_graphs is not None  # the load captured them (session.capture_graphs)
    else:
        proposer.capture_prefill_graphs(max_rows)
    proposer.kv_cache.storage.fill_(SENTINEL)
    proposer.pass_counts.clear()  # the load's warm-up ran before the graphs were captured
    run, tree_context, buckets = proposer._run, proposer._tree_context, []

    def replayed_as_eager(step: AttentionStep, positions: torch.Tensor, before: torch.Tensor, outputs: tuple,
                          eager: Callable[[], tuple]) -> None:  # fmt: skip
        """The replay's outputs and cache writes (made from the cache `before`) are the eager pass's."""
        assert proposer.prefill_graphs is not None
        buckets.append(proposer.prefill_graphs.bucket(step, positions.shape[0]))
        storage = proposer.kv_cache.storage
        replayed, written = [o.clone() for o in outputs], storage.clone()
        storage.copy_(before)
        expected = eager()
        assert [o.shape for o in replayed] == [o.shape for o in expected]
        for got, want in zip(replayed, expected, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
        torch.testing.assert_close(written, storage, atol=atol, rtol=0)  # the same slots, the same values
        assert not torch.equal(before, storage)  # the pass wrote its rows: the comparison above can see a write

    def checking(name: str, uniform: bool, step: AttentionStep, positions: torch.Tensor, **inputs: torch.Tensor):
        before, graphed = proposer.kv_cache.storage.clone(), proposer.pass_counts[f"{name} prefill graph"]
        outputs = run(name, uniform, step, positions, **inputs)
        if proposer.pass_counts[f"{name} prefill graph"] > graphed:
            replayed_as_eager(
                step, positions, before, outputs, lambda: proposer.passes[name].forward(step, positions, inputs)
            )
        return outputs

    def checking_tree(step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor):
        before, graphed = proposer.kv_cache.storage.clone(), proposer.pass_counts["tree_context prefill graph"]
        outputs = tree_context(step, positions, next_ids, features)
        if proposer.pass_counts["tree_context prefill graph"] > graphed:

            def eager() -> tuple:
                return proposer.context_pass_rows(step, positions, next_ids, features)

            replayed_as_eager(step, positions, before, outputs, eager)
        return outputs

    proposer._run = checking  # type: ignore[method-assign]
    proposer._tree_context = checking_tree  # type: ignore[method-assign]
    return session, buckets


def generate(session: ModelSession, prompt: list[int], max_tokens: int) -> list[int]:
    sink = Collector()
    session.engine.add(session.new_request("r", prompt, greedy(), max_tokens, sink))
    session.engine.run_until_idle()
    errors = [o.error for o in sink.outputs["r"] if o.error is not None]
    assert not errors, errors  # a failed check fails the step, and the engine the request
    return sink.tokens("r")
