"""`specdec server-info` and `specdec loads`: an executor's GetServerInfo and GetLoads, for an operator's terminal
(versions, device, backends, limits, uptime; running and queued requests, KV-cache use, tokens/s). `--each` asks
every replica behind a replicated address in turn."""

from __future__ import annotations

import argparse

from google.protobuf.message import Message

from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_runtime.client import add_channel_arguments, open_channel_from_args, resolved_addresses, server_address
from specdec_runtime.grpc_runtime import HelpFormatter

COMMANDS = {"server-info": "GetServerInfo", "loads": "GetLoads"}


def add_executor_commands(commands: argparse._SubParsersAction) -> None:
    helps = {
        "server-info": "an executor's versions, device, loaded model, backends, limits and uptime (GetServerInfo)",
        "loads": "an executor's running and queued requests, KV-cache use and tokens/s (GetLoads)",
    }
    for name, text in helps.items():
        parser = commands.add_parser(name, help=text, formatter_class=HelpFormatter)
        parser.add_argument(
            "--executor", type=server_address, default="127.0.0.1:50052", help="address of a running specdec-executor"
        )
        parser.add_argument(
            "--each",
            action="store_true",
            help="ask every address --executor resolves to, one by one (the replicas behind dns:///name:port); "
            "without it the call goes to one of them",
        )
        parser.add_argument("--json", action="store_true", help="print the response as JSON")
        parser.add_argument("--timeout", type=float, default=10.0, help="RPC deadline in seconds")
        add_channel_arguments(parser, "the executor")


def call_executor(args: argparse.Namespace) -> tuple[Message | dict[str, Message], str]:
    """The response of the command's RPC and its text rendering; with --each, the responses by address."""
    if not args.each:
        return _call_one(args, args.executor)
    responses, texts = {}, []
    for address in resolved_addresses(args.executor):
        responses[address], text = _call_one(args, address)
        texts.append(f"== {address}\n{text}")
    return responses, "\n\n".join(texts)


def _call_one(args: argparse.Namespace, address: str) -> tuple[Message, str]:
    with open_channel_from_args(address, args) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        if args.command == "server-info":
            info = stub.GetServerInfo(executor_pb2.GetServerInfoRequest(), timeout=args.timeout)
            return info, render_server_info(info)
        loads = stub.GetLoads(executor_pb2.GetLoadsRequest(), timeout=args.timeout)
        return loads, render_loads(loads)


def render_server_info(info: executor_pb2.GetServerInfoResponse) -> str:
    hardware = info.capabilities
    lines = [
        f"specdec {info.server_version}, torch {info.torch_version}, grpc {info.grpc_version}",
        f"device: {common_pb2.Platform.Name(hardware.platform)} {hardware.device_name}, "
        f"{hardware.device_count} device(s)",
        f"limits: {info.max_batch_size} requests per step, {info.max_queued_requests} in flight, "
        f"{info.max_prompt_tokens} prompt tokens",
        f"up {info.uptime_seconds:.1f} s (started at unix ms {info.started_unix_ms})",
    ]
    if not info.model_loaded:
        return "\n".join([*lines, "model: none loaded"])
    model = info.info
    drafter = common_pb2.SpecMethod.Name(model.spec_method)
    lines.append(
        f"model: {model.architecture}, {model.num_layers} layers, vocab {model.vocab_size}, context "
        f"{model.max_model_len}, {model.num_kv_blocks} KV blocks of {model.block_size}; drafter {drafter} "
        f"(k={model.num_speculative_tokens}); tokenizer: {_yes(model.has_tokenizer)}, chat template: "
        f"{_yes(model.has_chat_template)}, prefix caching: {_yes(model.prefix_caching)}"
    )
    draft = info.draft_backend.backend or "-"
    lines.append(f"backends: target {info.target_backend.backend}, drafter {draft}")
    return "\n".join(lines)


def render_loads(loads: executor_pb2.GetLoadsResponse) -> str:
    return "\n".join(
        [
            f"requests: {loads.running_requests} running, {loads.queued_requests} queued",
            f"KV cache: {loads.used_kv_blocks}/{loads.num_kv_blocks} blocks used ({100 * loads.kv_cache_usage:.1f}%), "
            f"{loads.cached_free_kv_blocks} free blocks holding cached prefixes",
            f"tokens: {loads.generation_tokens_per_second:.1f} generated per second over the last minute; "
            f"{loads.prompt_tokens_total} prompt and {loads.generation_tokens_total} generated in all",
            f"prefix cache: {loads.prefix_cache_hits} of {loads.prefix_cache_queries} prompt tokens reused "
            f"({100 * loads.prefix_cache_hit_rate:.1f}%)",
        ]
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
