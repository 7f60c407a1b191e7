"""Start the follower ranks as child processes of rank 0, watch them, and stop them.

`specdec-executor --tensor-parallel-size N` starts N - 1 followers (worker.py) on this host, rank r on
device index r (cuda:r; the CPU for every rank on a CPU run), then joins the group as rank 0. A watchdog
thread polls the children: one that exits marks the group broken (later steps fail with UNAVAILABLE) and
calls `on_failure` (the server goes NOT_SERVING); one that exits before the group is formed ends rank 0 with
the bad-setup status. The children get SIGTERM if rank 0 dies (Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
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
from executor_service.parallel.state import (
    KEEPALIVE_S,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
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


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when rank 0 dies, so no follower outlives it (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class Followers:
    def __init__(self, world_size: int, device: torch.device, model_root: Path | None) -> None:
        self.on_failure: Callable[[str], None] = lambda reason: None
        self._stopping = threading.Event()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world_size):
            command = [sys.executable, "-m", "executor_service.parallel.worker", "--rank", str(rank)]
            command += ["--world-size", str(world_size), "--init-method", init_method]
            command += ["--device", str(rank_device(device, rank))]
            command += ["--model-root", str(model_root)] if model_root else []
            self.processes.append(subprocess.Popen(command, preexec_fn=_die_with_parent))
        self._watchdog = threading.Thread(target=self._watch, name="specdec-tp-watchdog", daemon=True)
        self.group: TensorParallelGroup | None = None
        self._watchdog.start()
        self.group = init_tensor_parallel(0, world_size, init_method, rank_device(device, 0))

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            for rank, process in enumerate(self.processes, start=1):
                status = process.poll()
                if status is None:
                    continue
                reason = f"rank {rank} (pid {process.pid}) exited with status {status}"
                if self.group is None:  # rank 0 waits for it to join, for minutes: stop now instead
                    log.error("tensor-parallel %s while starting; exiting", reason)
                    logging.shutdown()
                    os._exit(EXIT_BAD_SETUP)
                log.error("tensor-parallel %s; the executor can no longer run steps", reason)
                self.group.fail(reason)
                self.on_failure(reason)
                return
            self._keep_alive()

    def _keep_alive(self) -> None:
        """A no-op to the followers when no op has gone out for KEEPALIVE_S (their wait has a timeout)."""
        group = self.group
        if group is None or group.failure is not None or time.monotonic() - group.last_op < KEEPALIVE_S:
            return
        if not group.lock.acquire(blocking=False):  # an op is on the wire: that is alive enough
            return
        try:
            protocol.send_header(group, protocol.Op.NOOP)
            group.last_op = time.monotonic()
        except RuntimeError as err:  # a follower is gone: the next poll sees its exit
            log.warning("tensor-parallel keep-alive failed: %s", str(err)[:200])
        finally:
            group.lock.release()

    def stop(self) -> None:
        """STOP to a healthy group, then wait for the children (SIGKILL to any that do not exit)."""
        self._stopping.set()
        group = self.group
        if group is not None and group.failure is None:
            try:
                with group.lock:
                    protocol.send_header(group, protocol.Op.STOP)
            except RuntimeError as err:
                log.warning("could not stop the followers cleanly: %s", err)
        for process in self.processes:
            try:
                process.wait(STOP_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        destroy_tensor_parallel()
