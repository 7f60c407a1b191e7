"""Shared fixtures: real specdec servers in subprocesses, reached over TCP.

`launch_server(service, *args)` starts `python -m <service>_service.main --port 0 --port-file ... *args` ("selector"
or "executor") and waits until the port file appears. `server.stop()` sends SIGTERM (unless `server.terminate()`
has already) and returns the exit status (None: still running after SHUTDOWN_TIMEOUT_S, so killed); when a test
leaves a server running, teardown stops it and fails unless it exits with status 0.

`selector_server` is a selector so started, `selector_address` its "127.0.0.1:PORT". `launch_executor(load, *args)`
starts an executor on the CPU, loading the LoadModelRequest file `load` (YAML or JSON) at start when given: its port
file appears before the model is loaded, so wait for health SERVING. `executor_server` is one with no model
(health NOT_SERVING until LoadModel), `executor_address` its "127.0.0.1:PORT".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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
HOST = "127.0.0.1"
SERVER_MODULES = {"selector": "selector_service.main", "executor": "executor_service.main"}


@dataclass
class ServerProcess:
    service: str  # "selector" or "executor"
    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path
    terminated: bool = False  # SIGTERM sent
    stopped: bool = False  # stop() has seen it exit (or killed it)
    killed: bool = False  # outlived SIGTERM by the shutdown timeout

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM once and return at once; the server drains meanwhile, and stop() waits for its exit."""
        if not self.terminated:
            self.process.send_signal(signal.SIGTERM)  # nothing if it has exited
            self.terminated = True

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> int | None:
        """SIGTERM (unless sent already) and wait (idempotent); the exit status, or None if it outlived `timeout`
        and was killed."""
        if not self.stopped:
            self.terminate()
            self.killed = wait_or_kill(self.process, timeout) is None
            self.stopped = True
        return None if self.killed else self.process.returncode

    def shutdown_failure(self) -> str:
        """Why stop() did not give status 0, with the server's log, for assertion messages."""
        outcome = "killed" if self.killed else f"status {self.process.returncode}"
        return f"{self.service} did not exit 0 within {SHUTDOWN_TIMEOUT_S} s of SIGTERM ({outcome}):\n{self.log()}"


def _wait_for_port(server: str, process: subprocess.Popen[bytes], port_file: Path, log_path: Path) -> int:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        # The server writes "PORT\n" in one go; wait for the newline so a half-written file is never read.
        text = port_file.read_text() if port_file.exists() else ""
        if text.endswith("\n") and text.strip().isdigit():
            return int(text)
        if process.poll() is not None:
            log = log_path.read_text(errors="replace")
            raise RuntimeError(f"{server} exited with status {process.returncode} before serving:\n{log}")
        time.sleep(0.05)
    log = log_path.read_text(errors="replace")
    raise TimeoutError(f"{server} wrote no port file within {STARTUP_TIMEOUT_S} s:\n{log}")


def wait_or_kill(process: subprocess.Popen[bytes], timeout: float = SHUTDOWN_TIMEOUT_S) -> int | None:
    """Wait for the exit; returns the exit status, or None if it had to be killed."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


@pytest.fixture
def launch_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """`launch_server(service, *args)`: a server subprocess on a free port of 127.0.0.1, logging as text to
    tmp_path; at teardown those the test has not stopped get SIGTERM, which must exit them with status 0."""
    servers: list[ServerProcess] = []

    def launch(service: str, *args: str) -> ServerProcess:
        name = f"{service}-{len(servers)}"
        port_file, log_path = tmp_path / f"{name}.port", tmp_path / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        command = [
            sys.executable, "-m", SERVER_MODULES[service],
            "--host", HOST, "--port", "0", "--port-file", str(port_file), "--log-format", "text", *args,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            port = _wait_for_port(name, process, port_file, log_path)
        except BaseException:
            process.send_signal(signal.SIGTERM)
            wait_or_kill(process)
            raise
        servers.append(ServerProcess(service, process, HOST, port, log_path))
        return servers[-1]

    yield launch
    # A test that stopped a server itself has checked the status already.
    running = [server for server in servers if not server.stopped]
    failures = [server.shutdown_failure() for server in running if server.stop() != 0]
    assert not failures, "\n\n".join(failures)


@pytest.fixture
def selector_server(launch_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A selector server subprocess on a free port; stopped with SIGTERM, which must exit it cleanly."""
    return launch_server("selector")


@pytest.fixture
def selector_address(selector_server: ServerProcess) -> str:
    """The "127.0.0.1:PORT" of a running selector server (see `selector_server`)."""
    return selector_server.address


@pytest.fixture
def launch_executor(launch_server: Callable[..., ServerProcess]) -> Callable[..., ServerProcess]:
    """`launch_executor(load=None, *args)`: an executor subprocess on the CPU; `load`, a LoadModelRequest file
    (YAML or JSON) it loads before serving (health turns SERVING once that is done)."""
    pytest.importorskip("torch", reason="the executor needs torch")

    def launch(load: Path | None = None, *args: str) -> ServerProcess:
        return launch_server("executor", "--device", "cpu", *(["--load", str(load)] if load else []), *args)

    return launch


@pytest.fixture
def executor_server(launch_executor: Callable[..., ServerProcess]) -> ServerProcess:
    """An executor subprocess on the CPU with no model loaded (see `launch_executor`)."""
    return launch_executor()


@pytest.fixture
def executor_address(executor_server: ServerProcess) -> str:
    """The "127.0.0.1:PORT" of a running executor (see `executor_server`)."""
    return executor_server.address
