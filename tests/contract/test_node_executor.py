"""Contract test: a Node.js gRPC client (@grpc/grpc-js, @grpc/proto-loader) against a real executor on the CPU.

The Node client loads a synthetic tiny llama, streams a greedy generation and decodes a BadRequest; what it got must
equal what a Python client gets from the same server for the same requests. Needs `node` on PATH and `npm install`
run in tests/contract/node; skipped otherwise.
"""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from specdec.v1 import executor_pb2, executor_pb2_grpc

PROMPT = [1, 2, 3, 4, 5]  # as in executor_contract.mjs
MAX_TOKENS = 6


def as_dict(message: Message) -> dict:
    """What proto-loader gives Node (keepCase, enums and 64-bit integers as strings, defaults filled in)."""
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def bad_request(err: grpc.RpcError) -> dict:
    status = rpc_status.from_call(err)
    assert status is not None, "no grpc-status-details-bin trailer"
    violations = []
    for detail in status.details:
        found = error_details_pb2.BadRequest()
        if detail.Unpack(found):
            violations.extend(as_dict(v) for v in found.field_violations)
    return {"code": err.code().value[0], "message": err.details(), "violations": violations}


@pytest.mark.node
def test_node_client_against_executor(run_node, executor_server) -> None:
    summary = json.loads(run_node("executor_contract.mjs", executor_server).splitlines()[-1])

    with grpc.insecure_channel(executor_server.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        assert summary["capabilities"] == as_dict(stub.GetCapabilities(executor_pb2.GetCapabilitiesRequest()))
        # The model Node loaded is the one serving, as Node decoded it.
        loaded = stub.GetModelInfo(executor_pb2.GetModelInfoRequest())
        assert summary["load"] == {"target_backend": as_dict(loaded.target_backend), "info": as_dict(loaded.info)}

        # Greedy is deterministic: the same request streams the same tokens to Python.
        request = executor_pb2.GenerateRequest(
            request_id="python",
            token_ids=executor_pb2.TokenIds(ids=PROMPT),
            sampling=executor_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        )
        responses = list(stub.Generate(request))
        token_ids = [t for response in responses for t in response.token_ids]
        assert len(token_ids) == MAX_TOKENS
        assert summary["generate"]["token_ids"] == token_ids
        assert summary["generate"]["finished"] == as_dict(responses[-1].finished)
        assert summary["generate"]["finished"]["finish_reason"] == "length"
        assert summary["generate"]["finished"]["completion_tokens"] == MAX_TOKENS

        # Node decoded the same rich status from the trailer as grpcio-status does.
        empty = executor_pb2.GenerateRequest(request_id="empty", token_ids=executor_pb2.TokenIds(ids=[]))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(empty))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert summary["bad_request"] == bad_request(err.value)
        assert [v["field"] for v in summary["bad_request"]["violations"]] == ["token_ids"]

    # Graceful shutdown is part of the contract: SIGTERM exits 0.
    status = executor_server.stop()
    assert status == 0, executor_server.shutdown_failure()
