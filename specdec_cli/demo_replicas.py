"""`specdec demo` against replicas behind one address (dns:///name:port): --no-load takes the model the executors
loaded at start (a LoadModel through the balanced channel would reach only one replica), and --requests N sends
the generation again, each call to the next replica by round_robin."""

from __future__ import annotations

from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_cli.demo_output import Output
from specdec_cli.demo_render import render_loaded


def served_model(out: Output, executor: executor_pb2_grpc.ExecutorStub, timeout: float) -> executor_pb2.ModelInfo:
    """--no-load: the model the executor (each replica) serves, from GetModelInfo."""
    out.section("the model the executor serves (Executor.GetModelInfo, --no-load)")
    out.step = "GetModelInfo on the executor"
    served = executor.GetModelInfo(executor_pb2.GetModelInfoRequest(), timeout=timeout)
    out.line(render_loaded(served, None))
    out.record("served", served)
    return served.info


def generate_again(
    out: Output,
    executor: executor_pb2_grpc.ExecutorStub,
    first: executor_pb2.GenerateRequest,
    requests: int,
    timeout: float | None,
) -> None:
    """--requests N: the first request N - 1 more times under new ids, one line each."""
    out.section(f"{requests - 1} more requests (Executor.Generate, the same request)")
    outcomes = []
    for number in range(2, requests + 1):
        request = executor_pb2.GenerateRequest()
        request.CopyFrom(first)
        request.request_id = f"{first.request_id}-{number}"
        out.step = f"Generate {number} of {requests} on the executor"
        tokens, reason = 0, ""
        for response in executor.Generate(request, timeout=timeout):
            tokens += len(response.token_ids)
            if response.HasField("finished"):
                reason = response.finished.finish_reason
        out.line(f"request {number} of {requests}: {tokens} tokens, {reason}")
        outcomes.append({"request_id": request.request_id, "tokens": tokens, "finish_reason": reason})
    out.record("more_requests", outcomes)
