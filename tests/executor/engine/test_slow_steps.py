"""SPECDEC_SLOW_STEP_MS (engine/slow_steps.py): a step slower than the threshold logs its time, batch, planned k and
the counters that moved in it; unset or not a number, the engine keeps no watcher."""

from __future__ import annotations

import logging

import pytest
from engine_driving import Collector
from executor_builders import greedy, tiny_session
from spec_builders import spec_session


def run(session) -> None:  # type: ignore[no-untyped-def]
    sink = Collector()
    session.engine.add(session.new_request("a", [3, 4, 5, 6], greedy(6), 6, sink))
    session.engine.run_until_idle()


@pytest.mark.parametrize("value", ["", "fast", "0"])
def test_off_without_a_positive_threshold(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_SLOW_STEP_MS", value)
    assert tiny_session().engine.slow is None


def test_every_step_over_the_threshold_is_logged_with_what_moved(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPECDEC_SLOW_STEP_MS", "0.000001")  # every step is slow
    session = spec_session("eagle3", 3)
    assert session.engine.slow is not None
    with caplog.at_level(logging.WARNING, logger="specdec.executor"):
        run(session)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step")]
    assert len(lines) == session.engine.slow.logged >= 3
    assert any("spec_step.eager" in line or "spec_step.eager following" in line for line in lines), lines
    assert all("ms, batch" in line for line in lines)


def test_a_high_threshold_logs_nothing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SPECDEC_SLOW_STEP_MS", "1e9")
    session = tiny_session()
    with caplog.at_level(logging.WARNING, logger="specdec.executor"):
        run(session)
    assert session.engine.slow is not None and session.engine.slow.logged == 0
    assert not [r for r in caplog.records if r.getMessage().startswith("slow step")]


def test_triton_compiles_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook on Triton's cache misses counts a kernel compiled for a new specialisation, once (GPU only: the
    interpreter compiles nothing)."""
    triton = pytest.importorskip("triton")
    import torch

    from executor_service.engine.one_time_work import TRITON_COMPILES, watch_triton_compiles

    if not torch.cuda.is_available():
        pytest.skip("Triton compiles for a GPU")
    watch_triton_compiles()
    before = TRITON_COMPILES.total()

    @triton.jit
    def add_one(x_ptr, size, BLOCK: triton.language.constexpr):  # type: ignore[no-untyped-def]
        offs = triton.language.arange(0, BLOCK)
        mask = offs < size
        triton.language.store(x_ptr + offs, triton.language.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.zeros(8, device="cuda")
    add_one[(1,)](x, 8, BLOCK=8)
    add_one[(1,)](x, 8, BLOCK=8)  # cached: not counted again
    add_one[(1,)](x, 8, BLOCK=16)
    named = sum(count for name, count in TRITON_COMPILES.items() if name.endswith("add_one"))  # qualified name
    assert TRITON_COMPILES.total() - before == 2 and named >= 2
    assert x.tolist() == [3.0] * 8
