"""What a settled k = 0 step of adaptive speculation does beyond a target-only step of the same batch (issue 31:
with a drafter the engine must be at least as fast as target-only at every batch). Host work a step adds is time
the device waits where the step is serial (before the overlapped decode step: 7-10 % of a step at batch 64 on the
H100, docs/executor.md, adaptive speculation), and steals from the next step's launch where it is overlapped.
Guards, on the CPU, for both kinds of step (serial, and overlapped: overlap_decode.py), each against target-only's
of the same kind:

- device work outside the target's pass: one copy (the verified rows into the deferred context's log) and no
  host-to-device copy (no index tensor); inside it, the drafter's features (an add per captured layer, one cat);
- host work: the Python calls a k = 0 step makes beyond a target-only step grow by a bounded number per request
  (the bookkeeping of the held rows and the proposal entries), counted outside the target's pass.

Negative controls: an indexed copy into the log (what a prefill chunk or an accepted path takes) is seen as extra
ops and a host tensor, and a per-request Python call added to the k = 0 path is seen by the host bound.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from executor_builders import greedy, tiny_session
from op_counting import OpCounter
from spec_builders import Scripted, spec_session

from executor_service.models.draft_config import feature_layers
from executor_service.server.session import ModelSession
from executor_service.spec_decode import deferred_context
from executor_service.spec_decode.deferred_context import DEFER_MAX, DeferredContext

K = 3
PROMPT = DEFER_MAX + 4  # a prefill longer than DEFER_MAX runs its context pass at once, as a real prompt's does
PER_REQUEST_CALLS = 16  # a k = 0 step's Python calls beyond target-only's, per request (measured: 14; 35 before)
OVERLAP = [pytest.param(False, id="serial"), pytest.param(True, id="overlapped")]
HOST_TENSORS = "lift_fresh"  # torch.tensor(list): on CUDA a host-to-device copy (attention_step.to_device)


def sessions(method: str, max_num_seqs: int, overlap: bool) -> tuple[ModelSession, ModelSession]:
    """Target-only and with `method`'s drafter, over the same target; a step takes every prompt whole; decode steps
    overlapped or serial in both."""
    sizes = {"num_kv_blocks": 128, "max_num_batched_tokens": 512, "max_num_seqs": max_num_seqs}
    pair = tiny_session(**sizes), spec_session(method, K, **sizes)
    for session in pair:
        session.engine.overlap_decode = overlap
    return pair


def settle(session: ModelSession, batch: int, k0: bool) -> None:
    """`batch` requests through their prefill and a first decode step; with a drafter, every step plans k = 0."""
    if k0:
        session.engine.speculation = Scripted([0], [0, K])
    for i in range(batch):
        prompt = [(7 * i + 3 * j) % 500 + 1 for j in range(PROMPT)]
        session.engine.add(session.new_request(f"r{i}", prompt, greedy(60), 60, lambda output: None))
    session.engine._drain_commands()
    for _ in range(2):
        session.engine.step()


def plain_step(session: ModelSession, measure: Callable[[], None]) -> None:
    """One step under `measure`; with a drafter it must be a plain deferred k = 0 step (no flush, no drafter pass)."""
    engine, deferred = session.engine, session.engine.deferred
    before = deferred.counts["deferred steps"] if deferred is not None else 0
    overlapped = engine.step_counts["overlapped decode"]
    measure()
    if deferred is not None:
        assert engine._planned == 0 and engine._flushed is None
        assert deferred.counts["deferred steps"] == before + 1
    assert (engine.step_counts["overlapped decode"] > overlapped) is engine.overlap_decode  # the kind asked for


@contextmanager
def target_pass_apart(session: ModelSession, inside: list[bool]) -> Iterator[None]:
    """`inside[0]` is True while the target's pass runs."""
    runner = session.engine.runner
    execute = runner.execute

    def marked(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return execute(*args, **kwargs)
        finally:
            inside[0] = False

    runner.execute = marked  # type: ignore[method-assign]
    try:
        yield
    finally:
        del runner.execute


class StepOps(OpCounter):
    """Dispatched ops by name, inside the target's pass and outside it; views (no kernel) left out."""

    def __init__(self, inside: list[bool]) -> None:
        super().__init__(lambda func: True)
        self.inside, self.ops = inside, {True: Counter[str](), False: Counter[str]()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name == HOST_TENSORS or not (func.is_view or name == "detach_"):
            self.ops[self.inside[0]][name] += 1
        return func(*args, **(kwargs or {}))


def step_ops(session: ModelSession) -> dict[bool, Counter[str]]:
    inside = [False]
    counter = StepOps(inside)

    def measure() -> None:
        with target_pass_apart(session, inside), counter:
            session.engine.step()

    plain_step(session, measure)
    return counter.ops


def step_calls(session: ModelSession) -> int:
    """Python calls (call and c_call events) of one step, the target's pass left out."""
    inside, calls = [False], [0]

    def hook(frame: Any, event: str, arg: Any) -> None:
        if not inside[0] and event in ("call", "c_call"):
            calls[0] += 1

    def measure() -> None:
        with target_pass_apart(session, inside):
            sys.setprofile(hook)
            try:
                session.engine.step()
            finally:
                sys.setprofile(None)

    plain_step(session, measure)
    return calls[0]


def extra_ops(method: str, overlap: bool) -> tuple[dict[bool, Counter[str]], ModelSession]:
    """The ops a settled k = 0 step dispatches beyond a target-only step of the same batch, in and out of the pass."""
    batch = 6
    target_only, drafting = sessions(method, 8, overlap)
    settle(target_only, batch, k0=False)
    settle(drafting, batch, k0=True)
    base, k0 = step_ops(target_only), step_ops(drafting)
    extra = {}
    for side in (True, False):
        found = Counter(k0[side])
        found.subtract(base[side])
        extra[side] = +found
        assert not -found, (side, -found)  # nothing fewer than target-only
    return extra, drafting


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("method", ["eagle", "eagle3", "dflash"])
def test_a_k0_step_adds_one_copy_and_the_drafters_features(method: str, overlap: bool) -> None:
    extra, session = extra_ops(method, overlap)
    assert extra[False] == Counter({"copy_": 1})  # the rows into the log; no index, no host-to-device copy
    assert session.proposer is not None
    layers = len(feature_layers(session.proposer.config))
    assert extra[True] == (Counter({"add": layers, "cat": 1}) if layers else Counter())


@pytest.mark.parametrize("overlap", OVERLAP)
def test_the_op_count_sees_an_indexed_copy(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Negative control: the step's rows copied into the log through an index built on the host, every step."""
    torch = deferred_context.torch

    def indexed(features: Any, count: int, start: int, log: Any) -> None:
        index = deferred_context.to_device(list(range(count)), torch.int64, features.device)
        torch.index_select(features, 0, index, out=log[start : start + count])

    def appending(self: DeferredContext, features: Any, sources: list[int], start: int) -> None:
        indexed(features, len(sources), start, self._buffer_like(features))

    def staging(self: DeferredContext, requests: list, features: Any) -> int:
        start, self.filled = self.filled, self.filled + len(requests)
        indexed(features, len(requests), start, self._buffer_like(features))
        return start

    monkeypatch.setattr(DeferredContext, "_append", appending)
    monkeypatch.setattr(DeferredContext, "stage", staging)
    extra, _ = extra_ops("eagle3", overlap)
    assert extra[False] == Counter({"index_select": 1, HOST_TENSORS: 1})


def per_request_calls(method: str, overlap: bool) -> float:
    """The Python calls a k = 0 step makes beyond a target-only step, per request: their growth from 4 to 12
    requests (what does not grow with the batch, the cost model's plan, cancels)."""
    extra = {}
    for batch in (4, 12):
        target_only, drafting = sessions(method, 16, overlap)
        settle(target_only, batch, k0=False)
        settle(drafting, batch, k0=True)
        extra[batch] = step_calls(drafting) - step_calls(target_only)
    return (extra[12] - extra[4]) / 8


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_k0_step_adds_few_host_calls_per_request(method: str, overlap: bool) -> None:
    assert 0 <= per_request_calls(method, overlap) <= PER_REQUEST_CALLS


@pytest.mark.parametrize("overlap", OVERLAP)
def test_the_call_count_sees_per_request_work(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """Negative control: a few more calls per request where the held rows are looked up (here the requests looked
    up again) show."""
    found = DeferredContext._found

    def looking_up(self: DeferredContext, entries: list) -> Any:
        for entry in entries:
            self.written(entry.request)
            self.holds_any([entry.request])
        return found(self, entries)

    monkeypatch.setattr(DeferredContext, "_found", looking_up)
    assert per_request_calls("eagle3", overlap) > PER_REQUEST_CALLS
