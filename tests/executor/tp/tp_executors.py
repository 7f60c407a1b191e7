"""A tensor-parallel executor server process and the follower processes it starts (imported as `tp_executors`:
pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format
from server_processes import ServerProcess, spawn_server

from specdec.v1 import executor_pb2


def child_pids(pid: int) -> list[int]:
    """Children of `pid` (the followers, started from one of its threads)."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def spawn_tp_executor(tmp_path: Path, request: executor_pb2.LoadModelRequest, size: int) -> ServerProcess:
    """A CPU executor at --tensor-parallel-size `size` that loads `request` at start (--load)."""
    load = tmp_path / "load.json"
    load.write_text(json.dumps(json_format.MessageToDict(request)))
    return spawn_server(
        "executor", "tp", tmp_path, "--device", "cpu", "--tensor-parallel-size", str(size), "--load", str(load)
    )
