"""A batch run with k scripted through held drafter context (deferred_context.py), fp32 on the CPU: what
test_deferred_context.py compares against a drafter that runs its context pass every step, and what
test_kernel_specialisation.py traces the kernels' inputs through."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from engine_driving import Collector, add_all
from executor_builders import greedy
from spec_builders import Scripted, spec_session
from tree_cases import tree_session

from executor_service.engine.request import Request
from executor_service.models.attention_step import cache_slot
from executor_service.server.session import ModelSession
from specdec.v1 import common_pb2

K = 3
# Short prompts: their prefill at k = 0 is held too, and a stretch of 5 steps ends before the bound.
BATCH = {"a": list(range(7, 12)), "b": [3 * i % 97 + 1 for i in range(9)], "c": [5 * i % 89 + 2 for i in range(10)]}


def session_for(method: str, tree: bool, device_step: bool = True, device: str = "cpu") -> ModelSession:
    """`device_step` off: every step takes the host path (verification on the host, the drafter's `propose`)."""
    backend = "CPU_ATTN" if device == "cpu" else "TRITON_ATTN"
    if tree:
        tree_shape = common_pb2.DraftTree(top_k=2, verify_budget=6)
        session = tree_session(method, tree_shape, k=K, backend=backend, device=device)
    else:
        session = spec_session(method, K, backend, max_num_batched_tokens=128, device=device)
    if not device_step:
        session.engine.spec_step = None
    return session


def drafter_cache(session: ModelSession, request: Request) -> torch.Tensor:
    """The drafter's K/V of the request's computed positions, every layer."""
    proposer = session.proposer
    assert proposer is not None
    slots = [cache_slot(request.block_ids, p, proposer.block_size) for p in range(request.num_computed_tokens)]
    storage = proposer.kv_cache.storage  # [L, 2, N, bs, H, D]
    flat = storage.reshape(storage.shape[0], 2, -1, *storage.shape[-2:])
    return flat[:, :, slots].clone()


@dataclass
class Trace:
    """Per step: each running request's drafts (ids, parents), its drafter K/V where nothing is held, the k the step
    planned, whether it flushed held context, whether it was a device step, and the drafter passes it ran."""

    drafts: list[dict[str, tuple[list[int], list[int]]]] = field(default_factory=list)
    caches: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    steps: list[tuple[int | None, bool, bool, Counter[str]]] = field(default_factory=list)
    most_held: int = 0  # rows one request held at most
    sink: Collector = field(default_factory=Collector)


def run(
    session: ModelSession, stretch: int, max_tokens: int, defer: bool = True, lose_a_row: bool = False,
    overlap: bool = True,
) -> Trace:  # fmt: skip
    """The batch with k scripted: `stretch` steps of k = 0 (the prompts' prefill among them), then 4 steps of the
    loaded size, round again. `defer` off: the context pass runs every step. `lose_a_row`: the negative control,
    one held row's features zeroed before it runs. `overlap` off: every decode step serially (on: k = 0 decode
    steps overlapped, their rows staged in the log before the step after them is launched)."""
    engine, proposer = session.engine, session.proposer
    assert proposer is not None
    engine.overlap_decode = overlap
    if not defer:
        engine.deferred = None
    size = proposer.num_draft_tokens
    engine.speculation = Scripted([0] * stretch + [size] * 4, [0, size])
    trace = Trace()
    add_all(session, BATCH, greedy(max_tokens), trace.sink)
    engine._drain_commands()
    for index in range(400):
        if not engine._has_work():
            break
        passes, device = Counter(proposer.pass_counts), engine.step_counts["device"]
        engine.step()
        ran = Counter(proposer.pass_counts)
        ran.subtract(passes)
        flushed = engine._flushed is not None
        running = engine.scheduler.running
        if running:  # (the last step, after which none runs, proposes for none)
            trace.steps.append((engine._planned, flushed, engine.step_counts["device"] > device, +ran))
        trace.drafts.append({r.request_id: (list(r.draft_ids), proposer.tree_of(r)) for r in running})
        deferred = engine.deferred
        if deferred is None or not deferred.held:
            trace.caches[index] = {r.request_id: drafter_cache(session, r) for r in running}
        else:
            trace.most_held = max(trace.most_held, *(h.rows for h in deferred.held.values()))
            if lose_a_row:  # once: the first held row of a request
                held = next(iter(deferred.held.values()))
                assert deferred._buffer is not None
                with torch.inference_mode():
                    deferred._buffer[held.at[0]].zero_()
                lose_a_row = False
    engine._flush_outbox()
    return trace
