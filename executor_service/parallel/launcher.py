"""Start the follower ranks as child processes of rank 0, watch them, and stop them.

`specdec-executor --tensor-parallel-size N` starts N - 1 followers (worker.py) on this host, rank r on
device index r (cuda:r; the CPU for every rank on a CPU run), then joins the group as rank 0. Rank 0's
messages go through a shared-memory ring (channel.py) that the followers map. A watchdog thread marks the
group broken (later steps fail with UNAVAILABLE) and calls `on_failure` (the server goes NOT_SERVING) when
- a follower exits (one that exits before the group is formed ends rank 0 with the bad-setup status);
- a follower's heartbeat is older than SPECDEC_TP_HEARTBEAT_TIMEOUT_S (frozen by SIGSTOP, wedged, gone);
- a step op has been in flight for SPECDEC_TP_STEP_WATCHDOG_S (a collective that will not meet), far below
  the collectives' own 5-minute timeout.
The children get SIGTERM if rank 0 dies (Linux), and exit when they see it gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from executor_service.parallel import protocol
from executor_service.parallel.channel import ControlRing
from executor_service.parallel.stack_dumps import dump_on_signal, dump_ranks
from executor_service.parallel.state import (
    HEARTBEAT_ENV,
    HEARTBEAT_TIMEOUT_S,
    STEP_WATCHDOG_ENV,
    STEP_WATCHDOG_S,
    TensorParallelGroup,
    destroy_tensor_parallel,
    env_seconds,
    init_tensor_parallel,
)
from executor_service.runner.cuda_graphs import StepGraphs
from specdec_runtime.grpc_runtime import EXIT_BAD_SETUP

log = logging.getLogger("specdec.executor")
POLL_SECONDS = 0.2
STOP_WAIT_SECONDS = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def release_graphs() -> None:
    """Free the CUDA graphs no one holds any more (a stopped engine's, in a reference cycle), and say which are
    still held: NCCL cannot tear a communicator down while a graph that captured its collectives lives."""
    gc.collect()
    held = sum(type(o) is StepGraphs for o in gc.get_objects())
    if held:
        log.warning("%d captured step graphs are still held at stop: the group may not tear down cleanly", held)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when rank 0 dies, so no follower outlives it (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class Followers:
    def __init__(self, world_size: int, device: torch.device, model_root: Path | None) -> None:
        self.on_failure: Callable[[str], None] = lambda reason: None
        self.step_watchdog_s = env_seconds(STEP_WATCHDOG_ENV, STEP_WATCHDOG_S)
        self.heartbeat_timeout_s = env_seconds(HEARTBEAT_ENV, HEARTBEAT_TIMEOUT_S)
        self._stopping = threading.Event()
        dump_on_signal()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.ring = ControlRing.create(world_size)
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world_size):
            command = [sys.executable, "-m", "executor_service.parallel.worker", "--rank", str(rank)]
            command += ["--world-size", str(world_size), "--init-method", init_method]
            command += ["--device", str(rank_device(device, rank)), "--control", str(self.ring.path)]
            command += ["--model-root", str(model_root)] if model_root else []
            self.processes.append(subprocess.Popen(command, preexec_fn=_die_with_parent))
        self._watchdog = threading.Thread(target=self._watch, name="specdec-tp-watchdog", daemon=True)
        self.group: TensorParallelGroup | None = None
        self._watchdog.start()
        try:
            self.group = init_tensor_parallel(0, world_size, init_method, rank_device(device, 0), self.ring)
        finally:
            self.ring.unlink()  # every follower has mapped it by the time the group forms

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            reason = self._failure()
            if reason is None:
                continue
            if self.group is None:  # rank 0 waits for it to join, for minutes: stop now instead
                log.error("tensor-parallel %s while starting; exiting", reason)
                logging.shutdown()
                os._exit(EXIT_BAD_SETUP)
            log.error("tensor-parallel %s; the executor can no longer run steps", reason)
            dump_ranks([p.pid for p in self.processes if p.poll() is None], reason)
            self.group.fail(reason)
            self.on_failure(reason)
            return

    def _failure(self) -> str | None:
        """Why the group can no longer run steps, if it cannot: a follower exited or stopped beating, or a step
        has run past the step watchdog."""
        for rank, process in enumerate(self.processes, start=1):
            status = process.poll()
            if status is not None:
                return f"rank {rank} (pid {process.pid}) exited with status {status}"
        group = self.group
        if group is None:
            return None
        if group.failure is not None:  # a failed op said so already; health must say it too
            return group.failure
        for rank, process in enumerate(self.processes, start=1):
            age = self.ring.heartbeat_age(rank)
            if age > self.heartbeat_timeout_s:
                return f"rank {rank} (pid {process.pid}) has not answered for {age:.1f} s (frozen or stuck)"
        since = group.step_since
        if since is not None and time.monotonic() - since > self.step_watchdog_s:
            return f"a step has not finished on every rank in {self.step_watchdog_s:g} s ({STEP_WATCHDOG_ENV})"
        return None

    def stop(self) -> None:
        """STOP to a healthy group and leave it (the followers leave theirs on STOP), then wait for
        the children (SIGKILL to any that do not exit)."""
        self._stopping.set()
        group = self.group
        stopped = False
        release_graphs()
        if group is not None and group.failure is None:
            try:
                with group.lock:
                    protocol.send_header(group, protocol.Op.STOP)
                stopped = True
            except (RuntimeError, ValueError) as err:
                log.warning("could not stop the followers cleanly: %s", err)
        if stopped and not destroy_tensor_parallel(STOP_WAIT_SECONDS):
            log.warning("the tensor-parallel group was not torn down in %g s; left to the exit", STOP_WAIT_SECONDS)
        for process in self.processes:
            try:
                process.wait(STOP_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if not stopped:
            destroy_tensor_parallel(0.0)  # forget the broken group: its NCCL communicator is aborted at exit
