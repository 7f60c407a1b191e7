"""`specdec`: the client command line.

specdec select --config request.yaml [--selector HOST:PORT | --local] [--json]
specdec backends [--platform cuda] [--selector HOST:PORT | --local] [--json]
specdec demo [--prompt TEXT] [--method eagle3] [--selector HOST:PORT] [--executor HOST:PORT] [--json]
specdec server-info | loads [--executor HOST:PORT | dns:///NAME:PORT [--each]] [--json]
specdec train-drafter --method {eagle,eagle3,dflash} --target PATH --out DIR ...   (needs the executor extra)
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_status import rpc_status

from selection.catalog import list_backends
from selection.selector import Selector
from specdec.v1 import common_pb2, selector_pb2, selector_pb2_grpc
from specdec_cli.demo import add_demo_arguments, run_demo
from specdec_cli.executor_commands import COMMANDS, add_executor_commands, call_executor
from specdec_cli.render import render_backends, render_error, render_selection
from specdec_cli.wrong_service import wrong_service_note
from specdec_runtime.client import add_channel_arguments, load_message, open_channel_from_args, server_address
from specdec_runtime.errors import SpecdecError
from specdec_runtime.grpc_runtime import HelpFormatter

EXIT_RPC_ERROR = 2


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--selector", type=server_address, default="127.0.0.1:50051", help="address of a running specdec-selector"
    )
    where.add_argument("--local", action="store_true", help="select in-process, without a server")
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.add_argument("--timeout", type=float, default=10.0, help="RPC deadline in seconds")
    add_channel_arguments(parser, "the selector")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    select = commands.add_parser(
        "select", help="decide the target's and drafter's attention backends", formatter_class=HelpFormatter
    )
    select.add_argument("--config", required=True, help="SelectBackendsRequest as YAML or JSON")
    _add_connection_arguments(select)
    backends = commands.add_parser(
        "backends", help="show the capability table and priority lists", formatter_class=HelpFormatter
    )
    backends.add_argument("--platform", choices=["cuda", "rocm", "cpu"], help="only this platform")
    _add_connection_arguments(backends)
    demo = commands.add_parser(
        "demo",
        help="start selector + executor here (or use --selector/--executor), "
        "select, load, generate speculatively, print decisions and acceptance",
        formatter_class=HelpFormatter,
    )
    add_demo_arguments(demo)
    add_executor_commands(commands)
    # Parsed by specdec_training.cli (main hands it the arguments): listed here for --help.
    commands.add_parser("train-drafter", help="train an EAGLE / EAGLE-3 / DFlash drafter for a target", add_help=False)
    return parser


def _call(args: argparse.Namespace, method: str, request: Message) -> Message:
    if args.local:
        if method == "SelectBackends":
            return Selector().select(request)
        return list_backends(request)
    with open_channel_from_args(args.selector, args) as channel:
        stub = selector_pb2_grpc.BackendSelectorStub(channel)
        return getattr(stub, method)(request, timeout=args.timeout)


def _print(args: argparse.Namespace, response: Message | dict[str, Message], text: str) -> None:
    if args.json and isinstance(response, dict):  # --each: the responses by address
        as_dicts = {
            k: json_format.MessageToDict(v, always_print_fields_with_no_presence=True) for k, v in response.items()
        }
        print(json.dumps(as_dicts, indent=2))
    elif args.json:
        print(json_format.MessageToJson(response, always_print_fields_with_no_presence=True))
    else:
        print(text)


def _wrong_service(args: argparse.Namespace) -> str | None:
    """For an UNIMPLEMENTED answer: which service answers at the address the command called, if not its own."""
    if args.command in COMMANDS:
        return wrong_service_note(args.executor, "specdec.v1.Executor", "--executor", args)
    if args.local:
        return None
    return wrong_service_note(args.selector, "specdec.v1.BackendSelector", "--selector", args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-drafter"]:  # torch is imported only for this command
        from specdec_training.cli import main as train_drafter

        return train_drafter(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    try:
        if args.command in COMMANDS:
            _print(args, *call_executor(args))
        elif args.command == "select":
            request = load_message(args.config, selector_pb2.SelectBackendsRequest())
            response = _call(args, "SelectBackends", request)
            _print(args, response, render_selection(response))
        else:
            platform = common_pb2.Platform.Value(f"PLATFORM_{args.platform.upper()}") if args.platform else 0
            response = _call(args, "ListBackends", selector_pb2.ListBackendsRequest(platform=platform))
            _print(args, response, render_backends(response))
    except SpecdecError as err:
        print(render_error(err.code.name, err.message, list(err.status_proto().details)), file=sys.stderr)
        return EXIT_RPC_ERROR
    except grpc.RpcError as err:
        detail = rpc_status.from_call(err)
        print(render_error(err.code().name, err.details(), list(detail.details) if detail else []), file=sys.stderr)
        if err.code() == grpc.StatusCode.UNIMPLEMENTED and (note := _wrong_service(args)):
            print(f"  {note}", file=sys.stderr)
        return EXIT_RPC_ERROR
    except (OSError, ValueError, json_format.ParseError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
