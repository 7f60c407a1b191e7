"""Start the specdec servers as child processes on a free local port, and stop them cleanly.

Each child gets its own session, so a Ctrl-C in the terminal reaches only the client, which then stops
the servers in order (SIGTERM, wait, exit status checked) instead of racing them. Logs go to a file
whose tail is shown when a server fails. SPECDEC_* variables are not passed on (see _private_environment).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0  # the executor imports torch before it binds
STOP_TIMEOUT_S = 20.0
COMMANDS = {
    "selector": ("specdec-selector", "selector_service.main"),
    "executor": ("specdec-executor", "executor_service.server.main"),
    "gateway": ("specdec-gateway", "gateway_service.main"),
}


class ServerError(RuntimeError):
    """A local server did not start, or did not stop with status 0."""


@dataclass
class LocalServer:
    name: str  # "selector" | "executor" | "gateway"
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    exit_status: int | None = None  # set by stop(); None: still running or killed

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM and wait; the exit status, or None if it outlived `timeout` and was killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.exit_status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            self.exit_status = None
        return self.exit_status


def server_command(name: str) -> list[str]:
    """The console script installed next to this interpreter (`specdec-selector`), else `python -m` its module."""
    script, module = COMMANDS[name]
    installed = Path(sys.executable).with_name(script)
    return [str(installed)] if installed.exists() else [sys.executable, "-m", module]


def start_server(name: str, log_dir: Path, *args: str, python: str | None = None) -> LocalServer:
    """Start `name` on a free port of 127.0.0.1 and return once it has bound (its port file is written then;
    an executor's model is not loaded yet). `python`: run it as `python -m` its module with that interpreter."""
    port_file, log_path = log_dir / f"{name}.port", log_dir / f"{name}.log"
    launch = [python, "-m", COMMANDS[name][1]] if python else server_command(name)
    command = [*launch, "--host", HOST, "--port", "0", "--port-file", str(port_file)]
    command += ["--log-format", "text", *args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_private_environment(),
            start_new_session=True,
        )
    server = LocalServer(name, process, 0, log_path)
    try:
        server.port = _wait_for_port(server, port_file)
    except BaseException:
        server.stop()
        raise
    return server


def _private_environment() -> dict[str, str]:
    """Ours without SPECDEC_* settings (TLS, auth token, metrics port, ...), which the servers read as flag
    defaults: a server started here is private to this client on 127.0.0.1 and configured by its flags."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("SPECDEC_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _wait_for_port(server: LocalServer, port_file: Path) -> int:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = port_file.read_text() if port_file.exists() else ""
        if text.endswith("\n") and text.strip().isdigit():  # written in one go; the newline marks the end
            return int(text)
        if server.process.poll() is not None:
            raise ServerError(
                f"{server.name} exited with status {server.process.returncode} before serving:\n{server.log_tail()}"
            )
        time.sleep(0.05)
    raise ServerError(f"{server.name} did not bind within {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


def stop_all(servers: list[LocalServer]) -> list[str]:
    """Stop in reverse start order (the executor before the selector it may call); one line per server
    that did not exit 0, with its log tail."""
    failures = []
    for server in reversed(servers):
        status = server.stop()
        if status != 0:
            outcome = f"status {status}" if status is not None else f"killed after {STOP_TIMEOUT_S:.0f} s"
            failures.append(f"{server.name} did not stop cleanly ({outcome}):\n{server.log_tail()}")
    return failures


def last_logged(path: Path, prefix: str) -> str | None:
    """What follows `prefix` on the newest line of a server's log that has it (None: no such line yet); the
    executor logs its load phases this way (executor_service/load_phases.py)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [line.partition(prefix)[2] for line in lines if prefix in line]
    return found[-1].strip() if found else None
