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
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_processes import ServerProcess, spawn_server


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


@pytest.fixture
def launch_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """`launch_server(service, *args)`: a server subprocess on a free port of 127.0.0.1, logging as text to
    tmp_path; at teardown those the test has not stopped get SIGTERM, which must exit them with status 0."""
    servers: list[ServerProcess] = []

    def launch(service: str, *args: str) -> ServerProcess:
        servers.append(spawn_server(service, f"{service}-{len(servers)}", tmp_path, *args))
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


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port of 127.0.0.1 that another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]
