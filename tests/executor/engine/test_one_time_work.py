"""A step that compiled a Triton kernel or captured a graph (one_time_work.py) gives adaptive speculation no price:
on the H200 such steps took 0.3-1.2 s against ~1 ms and, several in one window, set k = 0's median at 81-282 ms."""

from __future__ import annotations

import pytest
from engine_driving import Collector
from executor_builders import greedy
from spec_builders import spec_session

from executor_service.engine import one_time_work


def priced_steps(compiling: set[int], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps whose time the speculation recorded, the steps in `compiling` compiling a kernel."""
    session = spec_session("eagle3", 3, adaptive=True)
    engine, speculation = session.engine, session.engine.speculation
    assert speculation is not None
    steps, priced = [0], []
    run_step = engine._step

    def step(started: float) -> None:
        steps[0] += 1
        if steps[0] in compiling:
            one_time_work.TRITON_COMPILES["a kernel"] += 1
        run_step(started)

    record = speculation.record
    monkeypatch.setattr(engine, "_step", step)
    monkeypatch.setattr(speculation, "record", lambda *a: (priced.append(steps[0]), record(*a)))
    sink = Collector()
    for i in range(3):
        engine.add(session.new_request(f"r{i}", [3 + i, 4, 5, 6], greedy(24), 24, sink))
    engine.run_until_idle()
    return priced


def test_a_step_that_compiles_prices_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    every = priced_steps(set(), monkeypatch)
    assert len(every) > 5  # the negative control: steady steps are priced
    compiling = set(every[1:4])
    priced = priced_steps(compiling, monkeypatch)
    assert not compiling & set(priced)
    assert len(priced) >= len(every) - len(compiling) - 2  # the others still are (the plans may shift a step)
