"""`specdec-gateway --workers N`: N gateway processes on one port, started and stopped by this one.

One gateway process handles every request on one thread, so a burst of requests (64 streams started together) is
handed to the executors one request after another; N processes take a share each, on as many cores. The supervisor
checks the flags and files, binds N listening sockets to the same port (SO_REUSEPORT: the kernel spreads incoming
connections over them, so that no one worker's accept loop takes a whole burst), starts a worker per socket in a
fresh interpreter (spawn: each creates its own event loop and gRPC channel, nothing of grpc's crosses a fork),
and writes the port file and logs "serving" once every worker serves.

SIGTERM or SIGINT: it closes its copies of the sockets and passes SIGTERM on; each worker stops as a lone gateway
does (running generations get --grace-seconds), and it exits 0 once all have exited 0. A worker that dies while
serving is started again on the same socket (connections that came meanwhile wait in its queue); one that fails
before it serves stops the others, and the supervisor exits with its status. A worker whose supervisor is killed
outright stops by itself.

Metrics: every worker records into files of its own in a directory of the supervisor's (prometheus_client's
multiprocess mode, under /dev/shm where it can write, removed at exit); /metrics, from whichever worker answers,
and --metrics-port, served by the supervisor, add up every worker's."""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from gateway_service import main as gateway_main
from specdec_runtime.grpc_runtime import EXIT_BAD_SETUP, check_bindable
from specdec_runtime.logs import configure_logging

log = logging.getLogger("specdec.gateway")
KILL_MARGIN_S = 10.0  # beyond --grace-seconds, how long a stopping worker has before it is killed
RESTART_PAUSE_S = 1.0  # between a worker's death and its replacement
START_TIMEOUT_S = 60.0


@dataclass
class _Worker:
    index: int
    sock: socket.socket
    process: Any = None  # multiprocessing's Process
    ready: Connection | None = None  # the worker's word that it serves (EOF if it dies first)
    serving: bool = False
    started: float = field(default_factory=time.monotonic)


def supervise(args: argparse.Namespace) -> int:
    """Run --workers gateway processes until SIGTERM or SIGINT: the exit status."""
    try:
        tls, http = gateway_main.check_setup(args)
        gateway_main.tokens(args)
        check_bindable(args.host, args.port)
        sockets = reuse_port_sockets(args.host, args.port, args.workers)
    except (OSError, ValueError) as err:
        log.error("cannot serve: %s", err)
        return EXIT_BAD_SETUP
    metrics_dir = tempfile.mkdtemp(prefix="specdec-gateway-metrics-", dir=_memory_dir())
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by prometheus_client as each worker imports it
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    context = multiprocessing.get_context("spawn")
    workers = [_Worker(index, sock) for index, sock in enumerate(sockets)]
    try:
        for worker in workers:
            _start(context, worker, args, metrics_dir)
        failed = _run(context, workers, args, metrics_dir, stopping, tls, http)
        for sock in sockets:
            sock.close()  # the workers close theirs as they stop: new connections are refused, as by a lone gateway
        stopped = _stop(workers, args.grace_seconds)
        return failed or stopped
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def reuse_port_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one port (the first one's, for port 0), SO_REUSEPORT each."""
    sockets = [gateway_main.listening_socket(host, port, reuse_port=True)]
    bound = sockets[0].getsockname()[1]
    try:
        sockets += [gateway_main.listening_socket(host, bound, reuse_port=True) for _ in range(count - 1)]
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _memory_dir() -> str | None:
    """/dev/shm where this process can write there (the metrics' files then live in memory, as prometheus_client
    advises, and a read-only root filesystem is no obstacle), else the temporary directory's default."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None


def _start(context: Any, worker: _Worker, args: argparse.Namespace, metrics_dir: str) -> None:
    reader, writer = context.Pipe(duplex=False)
    worker.process = context.Process(
        target=run_worker,
        args=(args, worker.index, worker.sock, writer, os.getpid(), metrics_dir),
        name=f"specdec-gateway-worker-{worker.index}",
    )
    worker.process.start()
    writer.close()  # the worker holds the other copy: its exit is EOF here
    worker.ready, worker.serving, worker.started = reader, False, time.monotonic()


def _run(
    context: Any,
    workers: list[_Worker],
    args: argparse.Namespace,
    metrics_dir: str,
    stopping: list[int],
    tls: bool,
    http: str,
) -> int:
    """Until a signal: 0; or the status of a worker that failed before it served."""
    announced = False
    while not stopping:
        waiting = {w.ready: w for w in workers if w.ready is not None}
        waiting.update({w.process.sentinel: w for w in workers})
        for ready in wait(list(waiting), timeout=0.5):
            worker = waiting[ready]
            if ready is worker.ready:
                try:
                    worker.ready.recv()
                    worker.serving = True
                except EOFError:  # it exited before it served; its sentinel says so too
                    pass
                worker.ready.close()
                worker.ready = None
            elif not worker.process.is_alive():
                status = _exited(worker, metrics_dir)
                if not worker.serving:
                    log.error("worker failed before it served", extra={"worker": worker.index, "status": status})
                    return status if status not in (0, None) else EXIT_BAD_SETUP
                log.warning("worker exited; starting it again", extra={"worker": worker.index, "status": status})
                time.sleep(RESTART_PAUSE_S)
                _start(context, worker, args, metrics_dir)
        late = [w.index for w in workers if not w.serving and time.monotonic() - w.started > START_TIMEOUT_S]
        if late:
            log.error("workers did not serve in time", extra={"workers": late})
            return EXIT_BAD_SETUP
        if not announced and all(w.serving for w in workers):
            announced = True
            _announce(args, workers, tls, http, metrics_dir)
    return 0


def _announce(args: argparse.Namespace, workers: list[_Worker], tls: bool, http: str, metrics_dir: str) -> None:
    port = workers[0].sock.getsockname()[1]
    if args.metrics_port >= 0:
        from prometheus_client import start_http_server

        from gateway_service.metrics import workers_registry

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=workers_registry(metrics_dir))
    loop = gateway_main.event_loop(args.event_loop)
    where = {"address": f"{args.host}:{port}", "tls": tls, "executor": args.executor, "loop": loop, "http": http}
    log.info("serving", extra={**where, "workers": len(workers)})
    if args.port_file:
        Path(args.port_file).write_text(f"{port}\n")


def _stop(workers: list[_Worker], grace_seconds: float) -> int:
    """SIGTERM to every worker, and wait: 0 if every one exited 0 (one still running after the grace and
    KILL_MARGIN_S is killed)."""
    for worker in workers:
        if worker.process.is_alive():
            worker.process.terminate()
    deadline = time.monotonic() + grace_seconds + KILL_MARGIN_S
    statuses = []
    for worker in workers:
        worker.process.join(max(deadline - time.monotonic(), 0))
        if worker.process.is_alive():
            log.error("worker did not stop: killed", extra={"worker": worker.index})
            worker.process.kill()
            worker.process.join()
            statuses.append(None)
        else:
            statuses.append(worker.process.exitcode)
        if worker.ready is not None:
            worker.ready.close()
    log.info("stopped", extra={"workers": len(workers)})
    return 0 if all(status == 0 for status in statuses) else 1


def _exited(worker: _Worker, metrics_dir: str) -> int | None:
    """The exit status of a worker that has exited; its live gauges leave the sums."""
    from prometheus_client import multiprocess

    worker.process.join()
    multiprocess.mark_process_dead(worker.process.pid, metrics_dir)
    return worker.process.exitcode


def run_worker(
    args: argparse.Namespace, index: int, sock: socket.socket, ready: Connection, parent: int, metrics_dir: str
) -> None:
    """A worker process's body (the supervisor starts it): serve on `sock` until SIGTERM, then exit."""
    configure_logging(args.log_level, args.log_format)

    def serving() -> None:
        with contextlib.suppress(OSError):
            ready.send(index)
            ready.close()

    status = gateway_main.run(args, gateway_main.Worker(index, sock, serving, parent, metrics_dir))
    raise SystemExit(status)
