"""A server subprocess shared by a module's fuzz examples, started again when an example has broken it.

Each example starts from a server that answers a known-good request: when the previous example left it crashed,
hung or refusing everything, the server is killed and started afresh (and the example that broke it has failed
already), so hypothesis can shrink a failure without every later example failing for the same reason.
The executor runs under an address-space limit: like a container's memory limit, it turns a request that makes
the process allocate gigabytes into a failed allocation the server must answer cleanly, not into a machine
that swaps or an OOM kill.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from server_processes import ServerProcess, spawn_server, wait_or_kill

ADDRESS_SPACE_LIMIT_BYTES = 6 << 30  # an idle executor maps about 1.6 GB


class FuzzedServer:
    """`service` ("selector" or "executor") started with `args`; `prepare(self)` runs after each start (e.g. a
    LoadModel), `probe(self)` raises unless the server answers a known-good request."""

    def __init__(
        self,
        service: str,
        directory: Path,
        args: tuple[str, ...],
        prepare: Callable[[FuzzedServer], None],
        probe: Callable[[FuzzedServer], None],
        limit_memory: bool = False,
    ) -> None:
        self.service, self.directory, self.args = service, directory, args
        self._prepare, self._probe, self.limit_memory = prepare, probe, limit_memory
        self.restarts: list[str] = []  # why each restart was needed
        self.process: ServerProcess | None = None
        self.channel: grpc.Channel | None = None
        self.start()

    def start(self) -> None:
        name = f"{self.service}-{len(self.restarts)}"
        limit = ADDRESS_SPACE_LIMIT_BYTES if self.limit_memory else None
        self.process = spawn_server(self.service, name, self.directory, *self.args, address_space_limit=limit)
        self.channel = grpc.insecure_channel(self.process.address)
        self._prepare(self)

    @property
    def address(self) -> str:
        assert self.process is not None
        return self.process.address

    def metrics_port(self) -> int:
        assert self.process is not None
        port = self.process.metrics_port()
        assert port is not None, f"the {self.service} logged no metrics port (start it with --metrics-port 0)"
        return port

    def log_tail(self, chars: int = 4000) -> str:
        return self.process.log()[-chars:] if self.process is not None else ""

    def check_serving(self, context: str = "") -> None:
        """The known-good request still works (AssertionError with the log's tail if not)."""
        assert self.process is not None
        alive = self.process.process.poll() is None
        assert alive, f"the {self.service} exited ({self.process.process.returncode}) {context}:\n{self.log_tail()}"
        try:
            self._probe(self)
        except (grpc.RpcError, AssertionError) as err:
            raise AssertionError(f"the {self.service} stopped serving {context}: {err}\n{self.log_tail()}") from err

    def ready(self) -> None:
        """Before an example: serving, or killed and started again."""
        try:
            self.check_serving()
        except AssertionError as err:
            self.restarts.append(str(err).splitlines()[0])
            self.kill()
            self.start()

    def kill(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and not self.process.stopped:
            self.process.process.send_signal(signal.SIGKILL)
            wait_or_kill(self.process.process)
            self.process.stopped = True

    def stop(self) -> str | None:
        """SIGTERM; None if it exited 0, else why not (with the log)."""
        if self.channel is not None:
            self.channel.close()
        assert self.process is not None
        return None if self.process.stop() == 0 else self.process.shutdown_failure()
