"""`specdec demo` against replicas behind one address (issue 19): two CPU executors that loaded the demo's synthetic
model at start, one `ipv4:` target for both (what dns:///name:port resolves to), --no-load (a LoadModel would reach
only one) and --requests 4: the generations are spread over both, counted by each replica's own GetLoads."""

from __future__ import annotations

import json

import grpc
from google.protobuf import json_format
from server_processes import wait_address_serving

from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_cli.cli import main
from specdec_cli.demo_model import synthetic_model


def admitted(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        loads = executor_pb2_grpc.ExecutorStub(channel).GetLoads(executor_pb2.GetLoadsRequest(), timeout=10)
    return loads.prompt_tokens_total


def test_demo_spreads_requests_over_replicas_it_does_not_load(launch_executor, tmp_path, capsys) -> None:
    load = tmp_path / "load.json"
    load.write_text(json_format.MessageToJson(synthetic_model("eagle3", None).load))
    replicas = [launch_executor(load).address for _ in range(2)]
    for address in replicas:
        wait_address_serving(address)
    target = "ipv4:" + ",".join(replicas)
    argv = ["demo", "--synthetic", "--executor", target, "--no-load", "--requests", "4", "--max-tokens", "8"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["executor_address"] == target
    assert report["served"]["info"]["numSpeculativeTokens"] == 3 and "loaded" not in report
    first = report["finished"]
    assert (first["finishReason"], first["completionTokens"]) == ("length", 8)
    more = report["more_requests"]
    assert [(m["tokens"], m["finish_reason"]) for m in more] == [(8, "length")] * 3
    prompt_tokens = first["promptTokens"]
    served = [admitted(address) // prompt_tokens for address in replicas]
    assert sum(served) == 4 and all(count > 0 for count in served), served


def test_no_load_needs_a_running_executor(capsys) -> None:
    assert main(["demo", "--synthetic", "--no-load"]) == 1
    assert "--no-load uses the model a running executor serves" in capsys.readouterr().err
