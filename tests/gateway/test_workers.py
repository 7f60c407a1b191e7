"""`specdec-gateway --workers 2` in front of the real executor: two worker processes on one port (SO_REUSEPORT),
both serving requests, /metrics counting every worker's requests whichever answers, a worker killed outright
started again, and SIGTERM to the supervisor: a stream under way still ends in [DONE], every process exits, the
supervisor with status 0. Linux (/proc tells which worker holds which connection)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest
from gateway_stack import MODEL, TOKEN, http
from gateway_streams import NO_HANG_S, open_request

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
AUTH = {"Authorization": f"Bearer {TOKEN}"}
COMPLETION = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}


def worker_pids(supervisor: int) -> set[int]:
    """The supervisor's children that are gateway workers (multiprocessing's resource tracker is one too)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return {int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()}


def connections_held(pid: int, port: int) -> int:
    """Established TCP connections on local `port` whose socket the process `pid` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with_socket = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd)) if fd.is_symlink() else None
        if with_socket:
            inodes.add(with_socket.group(1))
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            held += local_port == port and state == "01" and inode in inodes
    return held


def requests_counted(address: str) -> float:
    _, text = http("GET", f"http://{address}/metrics")
    found = re.search(r'^specdec_gateway_requests_total\{route="completion",status="200"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + NO_HANG_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_two_workers_serve_count_together_and_stop_cleanly(stack, launch_gateway):
    gateway = launch_gateway(stack.executor.address, "--auth-token", TOKEN, "--workers", "2")
    host, port = gateway.address.split(":")
    workers = worker_pids(gateway.process.pid)
    assert len(workers) == 2, gateway.log()

    # New connections, a request on each, kept open, until both workers hold one: the kernel spreads them.
    connections: list[HTTPConnection] = []
    while not all(connections_held(pid, int(port)) for pid in workers):
        assert len(connections) < 64, "every connection went to one worker"
        connection = HTTPConnection(host, int(port), timeout=NO_HANG_S)
        connection.request("POST", "/v1/completions", body=json.dumps(COMPLETION), headers=AUTH)
        answer = connection.getresponse()
        assert answer.status == 200, answer.read()
        answer.read()
        connections.append(connection)
    # Whichever worker answers /metrics (a new connection each time) counts both workers' requests.
    assert {requests_counted(gateway.address) for _ in range(6)} == {float(len(connections))}
    for connection in connections:
        connection.close()

    # A worker killed outright is started again; the gateway keeps serving.
    killed = min(workers)
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: len(worker_pids(gateway.process.pid) - {killed}) == 2, "the killed worker was not replaced")
    workers = worker_pids(gateway.process.pid)
    for _ in range(4):
        status, body = http("POST", f"http://{gateway.address}/v1/completions", COMPLETION, AUTH)
        assert status == 200, body

    # SIGTERM with a stream under way: it still ends in [DONE]; every worker exits, the supervisor with 0.
    sock = open_request(gateway.address, {**COMPLETION, "max_tokens": 64, "ignore_eos": True, "stream": True})
    received = b""
    while b"data: {" not in received:
        received += sock.recv(65536)
    gateway.terminate()
    while not received.endswith(b"\r\n0\r\n\r\n") and (chunk := sock.recv(65536)):  # the chunked body's end
        received += chunk
    sock.close()
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), received[-300:]
    assert gateway.stop() == 0, gateway.log()
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), gateway.log()
