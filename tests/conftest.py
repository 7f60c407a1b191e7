"""Shared fixtures: a real selector server in a subprocess, reached over TCP.

`selector_server` starts `python -m selector_service.main --port 0 --port-file ...` and waits until the port
file appears. `server.stop()` sends SIGTERM and returns the exit status (None: still running after
SHUTDOWN_TIMEOUT_S, so killed); when a test leaves the server running, teardown stops it and fails unless it
exits with status 0. `selector_address` is its "127.0.0.1:PORT".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Kernels run on the GPU when there is one, else on the CPU with Triton's interpreter (single-threaded:
    it runs thousands of tiny numpy matmuls, which a BLAS thread pool makes several times slower)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        import torch
    except ImportError:  # a selector-only install: no kernels to run
        return
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
        # Must be set before any @triton.jit runs: kernels are built as interpreted functions then.
        os.environ.setdefault("TRITON_INTERPRET", "1")


STARTUP_TIMEOUT_S = 20.0
SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class SelectorServer:
    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path
    killed: bool = False  # outlived SIGTERM by the shutdown timeout

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def stopped(self) -> bool:
        return self.process.returncode is not None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> int | None:
        """SIGTERM and wait (idempotent); the exit status, or None if it outlived `timeout` and was killed."""
        if not self.stopped:
            self.killed = stop_process(self.process, timeout) is None
        return None if self.killed else self.process.returncode

    def shutdown_failure(self) -> str:
        """Why stop() did not give status 0, with the server's log, for assertion messages."""
        outcome = "killed" if self.killed else f"status {self.process.returncode}"
        return f"selector did not exit 0 within {SHUTDOWN_TIMEOUT_S} s of SIGTERM ({outcome}):\n{self.log()}"


def _wait_for_port(process: subprocess.Popen[bytes], port_file: Path, log_path: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The server writes "PORT\n" in one go; wait for the newline so a half-written file is never read.
        text = port_file.read_text() if port_file.exists() else ""
        if text.endswith("\n") and text.strip().isdigit():
            return int(text)
        if process.poll() is not None:
            log = log_path.read_text(errors="replace")
            raise RuntimeError(f"selector exited with status {process.returncode} before serving:\n{log}")
        time.sleep(0.05)
    raise TimeoutError(f"selector wrote no port file within {timeout} s:\n{log_path.read_text(errors='replace')}")


def stop_process(process: subprocess.Popen[bytes], timeout: float = SHUTDOWN_TIMEOUT_S) -> int | None:
    """SIGTERM, then wait; returns the exit status, or None if it had to be killed."""
    if process.poll() is not None:
        return process.returncode
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


@pytest.fixture
def selector_server(tmp_path: Path) -> Iterator[SelectorServer]:
    """A selector server subprocess on a free port; stopped with SIGTERM, which must exit it cleanly."""
    port_file = tmp_path / "selector.port"
    log_path = tmp_path / "selector.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", "selector_service.main",
        "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file), "--log-format", "text",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        port = _wait_for_port(process, port_file, log_path, STARTUP_TIMEOUT_S)
    except BaseException:
        stop_process(process)
        raise
    server = SelectorServer(process, "127.0.0.1", port, log_path)
    stopped_by_test = False
    try:
        yield server
        stopped_by_test = server.stopped
    finally:
        status = server.stop()
    # A test that stopped the server itself has checked the status already.
    if not stopped_by_test:
        assert status == 0, server.shutdown_failure()


@pytest.fixture
def selector_address(selector_server: SelectorServer) -> str:
    """The "127.0.0.1:PORT" of a running selector server (see `selector_server`)."""
    return selector_server.address
