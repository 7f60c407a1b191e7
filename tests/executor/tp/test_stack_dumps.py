"""A stalled rank can be asked where it is: SIGUSR1 dumps every thread's Python stack to stderr and the process
goes on; rank 0's watchdog dumps its own and signals the followers (parallel/stack_dumps.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
ROOT = Path(__file__).resolve().parents[3]
WAITER = """
import sys, time
from executor_service.parallel.stack_dumps import dump_on_signal
dump_on_signal()
def waiting_for_rank_zero():
    print("ready", flush=True)
    time.sleep(60)
waiting_for_rank_zero()
"""


def test_sigusr1_dumps_the_stacks_and_the_process_goes_on() -> None:
    env = os.environ | {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(
        [sys.executable, "-c", WAITER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(0.5)
        assert process.poll() is None, "SIGUSR1 ended the process"
    finally:
        process.kill()
        _, err = process.communicate(timeout=30)
    assert "waiting_for_rank_zero" in err, err


def test_the_watchdogs_dump_names_the_reason_and_signals_the_followers(capfd: pytest.CaptureFixture[str]) -> None:
    from executor_service.parallel.stack_dumps import dump_ranks

    follower = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dump_ranks([follower.pid], "a step has not finished")
        assert follower.wait(timeout=30) == -signal.SIGUSR1  # no handler there: the signal's default, it ends
    finally:
        follower.kill()
    err = capfd.readouterr().err
    assert "a step has not finished: Python stacks of rank 0" in err
    assert "test_the_watchdogs_dump_names_the_reason_and_signals_the_followers" in err


def test_a_command_past_its_timeout_leaves_every_process_stacks() -> None:
    from executor_service.parallel.stack_dumps import run_or_dump

    rank_and_follower = (
        "import subprocess, sys, time\n"
        "from executor_service.parallel.stack_dumps import dump_on_signal\n"
        "dump_on_signal()\n"
        f"subprocess.Popen([sys.executable, '-c', {WAITER!r}])\n"
        "def rank_zero_waits():\n"
        "    time.sleep(60)\n"
        "rank_zero_waits()\n"
    )
    env = os.environ | {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    finished = run_or_dump([sys.executable, "-c", rank_and_follower], env, timeout=5)
    assert finished.timed_out
    assert "rank_zero_waits" in finished.stderr and "waiting_for_rank_zero" in finished.stderr, finished.stderr
