"""A model build logs what it is doing, phase by phase, and where its time went (issue 36, item 8: a DFlash load
took 25-28 s on a CPU against EAGLE-3's 5 s, with nothing said meanwhile). specdec demo shows the phase beside its
spinner (last_logged over the executor's log) and prints the summary."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from executor_builders import load_request

from executor_service.load_phases import PHASE_PREFIX, SUMMARY_PREFIX
from executor_service.server.main import RunningExecutor
from specdec.v1 import executor_pb2_grpc
from specdec_cli.local_servers import last_logged

PHASES = ["target weights", "drafter weights", "KV cache and engine", "warm-up"]


async def test_a_load_logs_its_phases_and_their_seconds(
    executor: RunningExecutor, stub: executor_pb2_grpc.ExecutorStub, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specdec.executor")
    await stub.LoadModel(load_request(), timeout=60)
    messages = [record.getMessage() for record in caplog.records]
    assert [m.removeprefix(PHASE_PREFIX) for m in messages if m.startswith(PHASE_PREFIX)] == PHASES
    summaries = [m.removeprefix(SUMMARY_PREFIX) for m in messages if m.startswith(SUMMARY_PREFIX)]
    assert len(summaries) == 1
    named = [part.rsplit(" ", 2) for part in summaries[0].split(", ")]
    assert [name for name, _, _ in named] == PHASES
    assert all(unit == "s" and float(seconds) >= 0 for _, seconds, unit in named)


def test_the_demo_reads_the_newest_phase_from_a_text_log(tmp_path: Path) -> None:
    log = tmp_path / "executor.log"
    assert last_logged(log, PHASE_PREFIX) is None  # not written yet
    log.write_text(
        "2026-11-27 10:00:00,000 INFO specdec.server: serving\n"
        f"2026-11-27 10:00:01,000 INFO specdec.executor: {PHASE_PREFIX}target weights\n"
        f"2026-11-27 10:00:04,000 INFO specdec.executor: {PHASE_PREFIX}warm-up\n"
    )
    assert last_logged(log, PHASE_PREFIX) == "warm-up"
    assert last_logged(log, SUMMARY_PREFIX) is None
