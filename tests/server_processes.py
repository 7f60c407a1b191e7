"""Real specdec servers as subprocesses on 127.0.0.1, for the fixtures in tests/conftest.py and the fuzz suite.

`spawn_server(service, name, directory, *args)` starts `python -m <service>_service.main --port 0 --port-file ...
--log-format text *args` ("selector", "executor" or "gateway"), logging to `directory/<name>.log`, and returns once
the port file appears. Later flags win, so `*args` may override `--port`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120.0  # no-hang bounds, not performance bars (a loaded 2-core machine is slow)
SHUTDOWN_TIMEOUT_S = 60.0
HOST = "127.0.0.1"
SERVER_MODULES = {
    "selector": "selector_service.main",
    "executor": "executor_service.server.main",
    "gateway": "gateway_service.main",
}


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

    def metrics_port(self) -> int | None:
        """The Prometheus port the server logged (started with --metrics-port), or None."""
        found = re.search(r"metrics_port=(\d+)", self.log())
        return int(found.group(1)) if found else None

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

    def kill(self) -> int:
        """SIGKILL (a crash, as the kernel's OOM killer or `kill -9` makes it) and wait; the fixture's teardown
        then leaves the server alone. Returns the exit status (-9)."""
        self.process.kill()
        self.stopped = True
        return self.process.wait()

    def shutdown_failure(self) -> str:
        """Why stop() did not give status 0, with the server's log, for assertion messages."""
        outcome = "killed" if self.killed else f"status {self.process.returncode}"
        return f"{self.service} did not exit 0 within {SHUTDOWN_TIMEOUT_S} s of SIGTERM ({outcome}):\n{self.log()}"


# Sets the address-space limit, then becomes the server (exec keeps the limit and the pid). A preexec_fn would do
# it in the forked child instead, but a fork (no vfork with a preexec_fn) runs gRPC's fork handlers, which abort
# the child when this process's gRPC threads are busy (seen under xdist: "epoll_wait error: Bad file descriptor").
LIMITED_LAUNCH = (
    "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (n, n)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def spawn_server(
    service: str, name: str, directory: Path, *args: str, address_space_limit: int | None = None
) -> ServerProcess:
    """Start a server and wait for its port file; `address_space_limit`: its RLIMIT_AS in bytes."""
    port_file, log_path = directory / f"{name}.port", directory / f"{name}.log"
    port_file.unlink(missing_ok=True)  # a restarted server of the same name must not find the old port
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [
        sys.executable, "-m", SERVER_MODULES[service],
        "--host", HOST, "--port", "0", "--port-file", str(port_file), "--log-format", "text", *args,
    ]  # fmt: skip
    if address_space_limit is not None:
        command = [sys.executable, "-c", LIMITED_LAUNCH, str(address_space_limit), *command]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        port = _wait_for_port(name, process, port_file, log_path)
    except BaseException:
        process.send_signal(signal.SIGTERM)
        wait_or_kill(process)
        raise
    return ServerProcess(service, process, HOST, port, log_path)


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


def wait_address_serving(address: str, timeout: float = 300.0) -> None:
    """Until the executor at `address` has its model (loaded at start) and health says SERVING; `timeout` only
    against hanging."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while (
            health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.monotonic() < deadline, f"{address} not SERVING after {timeout} s"
            time.sleep(0.2)
