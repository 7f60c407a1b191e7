"""A model replaced by LoadModel at tensor-parallel size 2 serves, and a rank that dies (kill -9) while a stream
runs fails it with UNAVAILABLE: health goes NOT_SERVING, a new Generate is refused with UNAVAILABLE, and the
server still stops cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from executor_streams import END_AFTER_KILL_S, RPC_TIMEOUT_S, Stream, generate, wait_serving
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tp_executors import child_pids, spawn_tp_executor
from tp_greedy_run import load_request

from specdec.v1 import executor_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc for the follower's pid")
def test_a_rank_that_dies_fails_requests_with_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # three processes' thread pools on a 2-core machine
    request = load_request("none")
    request.num_kv_blocks = 512
    server = spawn_tp_executor(tmp_path, request, 2)
    try:
        with grpc.insecure_channel(server.address) as channel:
            wait_serving(channel, server)
            followers = child_pids(server.process.pid)
            assert len(followers) == 1, followers
            stub = executor_pb2_grpc.ExecutorStub(channel)
            request.num_kv_blocks = 256  # a second load beside the first: the followers build it, then drop the old
            assert stub.LoadModel(request, timeout=END_AFTER_KILL_S).info.num_kv_blocks == 256
            stream = Stream(stub, "long")
            stream.start()
            assert stream.first.wait(END_AFTER_KILL_S) and stream.error is None, stream.error
            os.kill(followers[0], signal.SIGKILL)
            stream.join(END_AFTER_KILL_S)
            assert not stream.is_alive(), "the stream still runs after its rank died"
            assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
            assert "tensor parallelism is broken" in (stream.error.details() or "")
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + END_AFTER_KILL_S
            while health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S).status != NOT_SERVING:
                assert time.monotonic() < deadline, "health still SERVING with a rank gone"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(generate("after", 4), timeout=RPC_TIMEOUT_S))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rank 1" in (refused.value.details() or ""), refused.value.details()
    finally:
        status = server.stop()
    assert status == 0, server.log()[-3000:]
    assert "tensor-parallel rank 1" in server.log()
