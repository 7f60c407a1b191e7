"""`specdec demo`: the whole flow, end to end, over real gRPC.

Start a selector and an executor here (or use running ones: --selector, --executor), ask the executor what
it can run (GetCapabilities), let the selector decide the target's and the drafter's attention backends
(SelectBackends), load both with exactly those backends (LoadModel), generate speculatively (Generate,
streamed), print the decisions, the output and the acceptance statistics, and stop what was started.
The model is SmolLM2-135M-Instruct with a drafter trained for it (demo_model.py); --synthetic: random weights.
--executor takes any gRPC target (dns:///name:port: replicas, balanced by round_robin); --no-load uses the model
they loaded at start, and --requests N sends the generation N times, spread over them.
Torch-free: the executor is its own process.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from executor_service.load_phases import PHASE_PREFIX, SUMMARY_PREFIX
from specdec.v1 import executor_pb2, executor_pb2_grpc, selector_pb2_grpc
from specdec_cli.demo_model import (
    DemoModel,
    default_model,
    dtype_for,
    selection_request,
    synthetic_model,
    with_backends,
)
from specdec_cli.demo_options import add_demo_arguments as add_demo_arguments  # the CLI imports it from here
from specdec_cli.demo_output import Output
from specdec_cli.demo_render import render_capabilities, render_finished, render_loaded
from specdec_cli.demo_replicas import generate_again, served_model
from specdec_cli.local_servers import LocalServer, ServerError, last_logged, start_server, stop_all
from specdec_cli.render import render_error, render_selection
from specdec_runtime.client import open_channel_from_args

EXIT_ERROR, EXIT_RPC_ERROR, EXIT_INTERRUPTED = 1, 2, 130
SHORT_CALL_TIMEOUT_S = 10.0  # health, GetCapabilities, SelectBackends, unless --timeout says otherwise
HEALTH = health_pb2.HealthCheckResponse.ServingStatus


class DemoError(Exception):
    """A failure the demo explains itself (no gRPC status to show)."""


def run_demo(args: argparse.Namespace) -> int:
    out = Output(args.json)
    servers: list[LocalServer] = []
    status = 0
    with tempfile.TemporaryDirectory(prefix="specdec-demo-") as log_dir:
        try:
            _flow(args, out, servers, Path(log_dir))
        except grpc.RpcError as err:
            detail = rpc_status.from_call(err)  # type: ignore[arg-type]
            message = render_error(err.code().name, err.details() or "", list(detail.details) if detail else [])
            out.error(f"error: {out.step} failed\n{message}")
            status = EXIT_RPC_ERROR
        except (DemoError, ServerError, OSError, ValueError) as err:
            out.error(f"error: {err}")
            status = EXIT_ERROR
        except KeyboardInterrupt:
            out.error("interrupted")
            status = EXIT_INTERRUPTED
        finally:
            failures = stop_all(servers)
        if servers:
            out.section("shutdown (SIGTERM, wait, exit status)")
            for server in reversed(servers):  # the order they were stopped in
                out.line(f"{server.name}: exit status {server.exit_status}")
            out.record("servers_stopped", {s.name: s.exit_status for s in servers})
        for failure in failures:
            out.error(f"error: {failure}")
    out.finish()
    return status or (EXIT_ERROR if failures else 0)


def _flow(args: argparse.Namespace, out: Output, servers: list[LocalServer], log_dir: Path) -> None:
    if args.no_load and not args.executor:
        raise DemoError("--no-load uses the model a running executor serves: give its address with --executor")
    if args.tree and args.k:
        raise DemoError("--tree sets the drafts per step (a dynamic tree's depth is its last number): drop --k")
    if args.synthetic:
        model = synthetic_model(args.method, args.k, args.tree)
    else:  # before any server starts: a missing drafter fails at once
        model = default_model(args.method, args.k, args.drafters, args.device, args.tree, args.temperature > 0)
    with ExitStack() as channels:
        opened = _connect(args, out, servers, log_dir, channels, model.model_root)
        executor = executor_pb2_grpc.ExecutorStub(opened["executor"])
        selector = selector_pb2_grpc.BackendSelectorStub(opened["selector"])
        health = functools.partial(_health, opened["executor"], short_deadline(args))
        if args.no_load:
            info = served_model(out, executor, short_deadline(args))
        else:
            local = next((server for server in servers if server.name == "executor"), None)
            log = local.log_path if local is not None else None
            info = _select_and_load(args, out, model, executor, selector, health, log)
        out.section("speculative generation (Executor.Generate, streamed)")
        request = _generate(args, out, model, executor, info)
        if args.requests > 1:
            generate_again(out, executor, request, args.requests, args.timeout)


def _connect(
    args: argparse.Namespace,
    out: Output,
    servers: list[LocalServer],
    log_dir: Path,
    channels: ExitStack,
    model_root: Path | None,
) -> dict[str, grpc.Channel]:
    """Channels to both servers: remote ones checked first (a wrong address fails before anything starts),
    then those not given started here; the executor started here validates backends with the selector
    started here (a remote selector may need TLS or a token that the executor is not given)."""
    remote = {"selector": args.selector, "executor": args.executor}
    opened: dict[str, grpc.Channel] = {}
    for name, address in remote.items():
        if address:
            opened[name] = channels.enter_context(open_channel_from_args(address, args))
            out.step = f"reaching the {name} at {address} (grpc.health.v1 Check)"
            _health(opened[name], short_deadline(args))
    out.section("servers")
    if not args.selector:
        servers.append(start_server("selector", log_dir))
    if not args.executor:
        extra = [] if args.selector else ["--selector-address", servers[0].address]
        extra += ["--model-root", str(model_root)] if model_root is not None else []
        servers.append(start_server("executor", log_dir, "--device", args.device, *extra))
    for name in ("selector", "executor"):
        local = next((s for s in servers if s.name == name), None)
        if local is not None:
            opened[name] = channels.enter_context(grpc.insecure_channel(local.address))
            where = f"started here, pid {local.process.pid}"
            if name == "executor":
                where += f", device {args.device}" + ("" if args.selector else ", validates backends with the selector")
        else:
            where = f"running already, --{name}"
        address = local.address if local else remote[name]
        out.line(f"{name:<9} {address}  ({where})")
        out.record(f"{name}_address", address)
    return opened


def _select_and_load(
    args: argparse.Namespace,
    out: Output,
    model: DemoModel,
    executor: executor_pb2_grpc.ExecutorStub,
    selector: selector_pb2_grpc.BackendSelectorStub,
    health: Callable[[], int],
    executor_log: Path | None = None,
) -> executor_pb2.ModelInfo:
    """GetCapabilities, SelectBackends from that report, LoadModel with exactly the selected backends. With the
    log of an executor started here, the progress shows its load phase and the report where the time went."""
    out.section("executor capabilities (Executor.GetCapabilities)")
    out.step = "GetCapabilities on the executor"
    hardware = executor.GetCapabilities(executor_pb2.GetCapabilitiesRequest(), timeout=short_deadline(args))
    out.line(render_capabilities(hardware))
    out.record("capabilities", hardware)

    out.section("backend selection (BackendSelector.SelectBackends, every candidate with its reasons)")
    load = model.load
    load.dtype = dtype_for(hardware)
    out.step = "SelectBackends on the selector"
    selection = selector.SelectBackends(selection_request(model, hardware), timeout=short_deadline(args))
    out.line(render_selection(selection))
    out.record("selection", selection)

    out.section("loading target and drafter (Executor.LoadModel)")
    for line in model.description:
        out.line(line)
    out.record("model", model.description)
    if model.note:
        out.line(f"note: {model.note}")
    out.step = "LoadModel on the executor"
    started = time.monotonic()
    future = executor.LoadModel.future(with_backends(load, selection), timeout=args.timeout)
    phase = functools.partial(last_logged, executor_log, PHASE_PREFIX) if executor_log else None
    loaded = out.wait_with_progress(future, "loading", health, phase)
    out.line(render_loaded(loaded, time.monotonic() - started))
    if executor_log and (summary := last_logged(executor_log, SUMMARY_PREFIX)):
        out.line(f"load phases: {summary}")
        out.record("load_phases", summary)
    for role, chosen, got in (
        ("target", selection.target, loaded.target_backend),
        ("drafter", selection.drafter, loaded.draft_backend),
    ):
        if got.backend != chosen.backend:
            raise DemoError(f"the executor loaded the {role} on {got.backend}, not the selected {chosen.backend}")
    out.step = "the executor's health check"
    status = health()
    out.line(f"executor health: {HEALTH.Name(status)}")
    if status != health_pb2.HealthCheckResponse.SERVING:
        raise DemoError("the executor does not report SERVING after LoadModel")
    out.record("loaded", loaded)
    return loaded.info


def _generate(
    args: argparse.Namespace,
    out: Output,
    model: DemoModel,
    executor: executor_pb2_grpc.ExecutorStub,
    info: executor_pb2.ModelInfo,
) -> executor_pb2.GenerateRequest:
    request = executor_pb2.GenerateRequest(request_id=f"demo-{uuid.uuid4().hex[:8]}")
    request.sampling.temperature = args.temperature
    request.sampling.max_tokens = args.max_tokens
    request.sampling.stop.extend(args.stop)
    if info.has_chat_template and not args.no_chat:  # the executor renders the model's chat template
        request.messages.messages.add(role="user", content=args.prompt)
        out.line(f"prompt: {args.prompt!r}, in the model's chat template")
    elif info.has_tokenizer:
        request.text = args.prompt
        out.line(f"prompt: {args.prompt!r}")
    else:
        ids = list(args.prompt.encode())
        if info.vocab_size < 256:
            raise DemoError(f"the model has no tokenizer and {info.vocab_size} ids: too few for the prompt's bytes")
        request.token_ids.ids.extend(ids)
        out.line(f"prompt: {args.prompt!r}")
        out.line(f"the model has no tokenizer: the prompt goes as its {len(ids)} UTF-8 bytes (ids 0-255)")
        out.line("and the output is printed as token ids")
    out.line("output, as it streams in:")
    out.step = "Generate on the executor"
    started = time.monotonic()
    token_ids: list[int] = []
    text: list[str] = []
    finished = None
    for response in executor.Generate(request, timeout=args.timeout):
        token_ids += response.token_ids
        text.append(response.text)
        out.stream(response.text if info.has_tokenizer else "".join(f" {t}" for t in response.token_ids))
        if response.HasField("finished"):
            finished = response.finished
    seconds = time.monotonic() - started
    out.stream("\n")
    if finished is None:
        raise DemoError("the Generate stream ended without its final message")
    out.section("acceptance statistics (the stream's final message)")
    out.line(render_finished(finished, seconds))
    out.record("prompt_text", request.text)
    out.record("prompt_messages", [{"role": m.role, "content": m.content} for m in request.messages.messages])
    out.record("prompt_token_ids", list(request.token_ids.ids))
    out.record("output_token_ids", token_ids)
    out.record("text", "".join(text))
    out.record("finished", finished)
    out.record("generate_seconds", round(seconds, 3))
    return request


def short_deadline(args: argparse.Namespace) -> float:
    """--timeout, else SHORT_CALL_TIMEOUT_S; LoadModel and Generate take --timeout as is (None: no deadline, since a
    loaded machine can take any time, and a fixed one failed slow runs)."""
    return args.timeout or SHORT_CALL_TIMEOUT_S


def _health(channel: grpc.Channel, timeout: float) -> int:
    request = health_pb2.HealthCheckRequest()
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout).status
