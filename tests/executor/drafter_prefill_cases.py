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
    tree: tuple[common_pb2.DraftTree, int] | None = None, batched: bool = False,
) -> tuple[ModelSession, list[int]]:  # fmt: skip
    """A session whose drafter (a chain, or `tree`: tree_cases.TREES' (tree, k)) has context-pass prefill graphs
    (captured at load on CUDA, here on the CPU; `batched`: several requests' too), every context pass through them
    checked against the eager pass over the same inputs and cache, within `atol` (the list returned collects each
    checked pass's bucket)."""
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
        assert not batched or proposer.batch_prefill_graphs is not None
    else:
        proposer.capture_prefill_graphs(max_rows)
        if batched:
            proposer.capture_batch_prefill_graphs(max_rows, 8)
    proposer.kv_cache.storage.fill_(SENTINEL)
    proposer.pass_counts.clear()  # the load's warm-up ran before the graphs were captured
    run, tree_context, buckets = proposer._run, proposer._tree_context, []

    def replayed_as_eager(step: AttentionStep, positions: torch.Tensor, before: torch.Tensor, outputs: tuple,
                          eager: Callable[[], tuple]) -> None:  # fmt: skip
        """The replay's outputs and cache writes (made from the cache `before`) are the eager pass's."""
        assert proposer.prefill_graphs is not None
        rows = proposer.prefill_graphs.bucket(step, positions.shape[0])
        if rows is None and proposer.batch_prefill_graphs is not None:
            rows = proposer.batch_prefill_graphs.bucket(step, positions.shape[0])
        buckets.append(rows)
        storage = proposer.kv_cache.storage
        replayed, written = [o.clone() for o in outputs], storage.clone()
        storage.copy_(before)
        expected = eager()
        assert [o.shape for o in replayed] == [o.shape for o in expected]
        for got, want in zip(replayed, expected, strict=True):
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
        torch.testing.assert_close(written, storage, atol=atol, rtol=0)  # the same slots, the same values
        assert not torch.equal(before, storage)  # the pass wrote its rows: the comparison above can see a write

    def replays(name: str) -> int:
        return proposer.pass_counts[f"{name} prefill graph"] + proposer.pass_counts[f"{name} batch prefill graph"]

    def checking(name: str, uniform: bool, step: AttentionStep, positions: torch.Tensor, **inputs: torch.Tensor):
        before, graphed = proposer.kv_cache.storage.clone(), replays(name)
        outputs = run(name, uniform, step, positions, **inputs)
        if replays(name) > graphed:
            replayed_as_eager(
                step, positions, before, outputs, lambda: proposer.passes[name].forward(step, positions, inputs)
            )
        return outputs

    def checking_tree(step: AttentionStep, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor):
        before, graphed = proposer.kv_cache.storage.clone(), replays("tree_context")
        outputs = tree_context(step, positions, next_ids, features)
        if replays("tree_context") > graphed:

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


def generate_together(session: ModelSession, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """The prompts added at once (their prefills in one step), generated to the end: each one's tokens."""
    sink = Collector()
    for rid, prompt in prompts.items():
        session.engine.add(session.new_request(rid, prompt, greedy(), max_tokens, sink))
    session.engine.run_until_idle()
    errors = [o.error for outputs in sink.outputs.values() for o in outputs if o.error is not None]
    assert not errors, errors
    return {rid: sink.tokens(rid) for rid in prompts}
