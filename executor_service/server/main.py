"""`specdec-executor`: serve the Executor gRPC service on one device until SIGTERM.

Health is NOT_SERVING until a model is loaded and warmed up (LoadModel, or --load at start). On SIGTERM
health goes NOT_SERVING, new generations are refused (UNAVAILABLE), running ones get --grace-seconds to finish
and are then aborted (their streams end with finish_reason "abort"); the server then goes on refusing until
calls stop coming in (STOP_LINGER_MAX_S at most), stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from executor_service import daemon_thread
from executor_service.models.model_paths import check_model_root
from executor_service.parallel.state import check_tensor_parallel_size
from executor_service.server.capabilities import default_device
from executor_service.server.metrics import EngineMetrics
from executor_service.server.prompt_intake import MAX_REQUEST_BYTES
from executor_service.server.selection import BackendChooser, SelectorClientSettings
from executor_service.server.servicer import SERVICE_NAME, ExecutorServicer
from executor_service.server.session import SAMPLED_DRAFTS, EngineSettings, adaptive_by_default
from specdec.v1 import executor_pb2, executor_pb2_grpc
from specdec_runtime.auth import resolve_token
from specdec_runtime.client import load_message, server_address
from specdec_runtime.errors import SpecdecError
from specdec_runtime.grpc_runtime import (
    EXIT_BAD_SETUP,
    EnvDefaultsParser,
    RunningServer,
    ServerSettings,
    add_server_arguments,
    create_server,
    start_server,
    wait_for_termination_signal,
)
from specdec_runtime.logs import configure_logging

if TYPE_CHECKING:
    from executor_service.parallel.launcher import Followers

DEFAULT_PORT = 50052
log = logging.getLogger("specdec.executor")


@dataclass(frozen=True)
class ExecutorOptions:
    device: torch.device
    model_root: Path | None = None
    selector_address: str | None = None
    selector_client: SelectorClientSettings = field(default_factory=SelectorClientSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    max_live_requests: int = 4096
    tensor_parallel_size: int = 1  # > 1: this process is rank 0 and starts the other ranks (parallel/)


# After the drain the server stays up, refusing, until no call has come in for STOP_QUIET_S (STOP_LINGER_MAX_S at
# most): calls that reached it while the loop was busy are still queued inside gRPC, and the final stop would
# cancel them (RunningServer.wait_until_quiet).
STOP_QUIET_S = 0.2
STOP_LINGER_MAX_S = 2.0


@dataclass
class RunningExecutor:
    server: RunningServer
    servicer: ExecutorServicer

    async def stop(self, grace_seconds: float) -> None:
        """NOT_SERVING, drain (new generations refused with UNAVAILABLE, running ones get `grace_seconds`), then
        stop the server only once calls have stopped coming in, so that every call that reached this replica
        ends with the service's own answer and none with the CANCELLED of gRPC's stop, which clients do not
        retry."""
        await self.server.health.enter_graceful_shutdown()
        await self.servicer.drain(grace_seconds)
        await self.server.wait_until_quiet(STOP_QUIET_S, STOP_LINGER_MAX_S)
        await self.server.server.stop(1.0)
        await self.servicer.chooser.close()


# The engine thread and the event loop share the GIL; Python's default 5 ms switch interval lets a busy
# loop hold the engine thread up for most of a decode step. 0.5 ms keeps steps back to back.
GIL_SWITCH_INTERVAL_S = 0.0005


async def start_executor(settings: ServerSettings, options: ExecutorOptions) -> RunningExecutor:
    sys.setswitchinterval(float(os.environ.get("SPECDEC_GIL_SWITCH_INTERVAL_S", GIL_SWITCH_INTERVAL_S)))
    server, rpc_metrics = create_server(settings, "executor", max_request_bytes=MAX_REQUEST_BYTES)
    holder: list[RunningServer] = []

    async def set_serving(serving: bool) -> None:
        if holder:
            await holder[0].set_serving(serving)

    servicer = ExecutorServicer(
        device=options.device,
        model_root=options.model_root,
        chooser=BackendChooser(options.selector_address, options.selector_client),
        engine_settings=options.engine,
        metrics=EngineMetrics(rpc_metrics.registry),
        set_serving=set_serving,
        max_live_requests=options.max_live_requests,
    )
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    running = await start_server(server, rpc_metrics, settings, [SERVICE_NAME], ready=False)
    holder.append(running)
    return RunningExecutor(running, servicer)


@dataclass(frozen=True)
class LoadAtStart:
    """--load: the file's name (for the log) and the request read from it before the server starts."""

    file: str
    request: executor_pb2.LoadModelRequest


async def serve(settings: ServerSettings, options: ExecutorOptions, load: LoadAtStart | None) -> int:
    followers = None
    if options.tensor_parallel_size > 1:
        from executor_service.parallel.launcher import Followers

        log.info("starting tensor-parallel ranks", extra={"tensor_parallel_size": options.tensor_parallel_size})
        followers = await asyncio.to_thread(Followers, options.tensor_parallel_size, options.device, options.model_root)
    try:
        return await _serve(settings, options, load, followers)
    finally:
        if followers is not None:
            await asyncio.to_thread(followers.stop)


async def _serve(
    settings: ServerSettings, options: ExecutorOptions, load: LoadAtStart | None, followers: Followers | None
) -> int:
    executor = await start_executor(settings, options)
    if followers is not None:  # a rank dead or stalled: health NOT_SERVING, open streams and new calls UNAVAILABLE
        loop = asyncio.get_running_loop()

        def not_serving(reason: str) -> None:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(executor.server.set_serving(False)))
            loop.call_soon_threadsafe(executor.servicer.ranks_failed, reason)

        followers.on_failure = not_serving
    signalled = asyncio.ensure_future(wait_for_termination_signal())  # SIGTERM during --load stops cleanly too
    status = await load_at_start(executor.servicer, load, signalled) if load else 0
    if status:
        signalled.cancel()
    else:
        await signalled
    await executor.stop(settings.grace_seconds if status == 0 else 0)
    log.info("stopped")
    return status


async def load_at_start(servicer: ExecutorServicer, load: LoadAtStart, signalled: asyncio.Future[None]) -> int:
    """--load: 0 once the model is loaded, or when SIGTERM comes first (the shutdown that follows cancels the
    load); 1 if it cannot be loaded."""
    load_file, request = load.file, load.request
    loading = asyncio.ensure_future(servicer.load(request))  # type: ignore[arg-type]
    await asyncio.wait({loading, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        loading.add_done_callback(_retrieve)
        return 0
    try:
        response = loading.result()
    except SpecdecError as err:
        log.error("cannot load %s: %s", load_file, err)
        return 1
    except Exception:
        log.exception("cannot load %s", load_file)
        return 1
    log.info("loaded at start", extra={"backend": response.target_backend.backend})
    return 0


def _retrieve(task: asyncio.Future[object]) -> None:
    """Take the outcome of a load cancelled by the shutdown, so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()


def add_selector_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--selector-address", type=server_address, help="ask this selector for backends (default: decide in-process)"
    )
    parser.add_argument("--selector-tls-ca", help="PEM CA that signed the selector's certificate (enables TLS)")
    parser.add_argument("--selector-tls-cert", help="PEM client certificate for a selector that wants mTLS")
    parser.add_argument("--selector-tls-key", help="PEM private key of --selector-tls-cert")
    parser.add_argument("--selector-tls-server-name", help="the selector's certificate name, if not the address's host")
    parser.add_argument(
        "--selector-auth-token",
        help="bearer token sent to the selector (default: this executor's own --auth-token / --auth-token-file, "
        "for one shared token per deployment)",
    )
    parser.add_argument("--selector-auth-token-file", help="read --selector-auth-token from this file")


def selector_client_settings(args: argparse.Namespace) -> SelectorClientSettings:
    """The selector channel's TLS files and token; without a selector token of its own the executor sends its
    own --auth-token, since one token shared by the whole deployment is the common case."""
    token = resolve_token(args.selector_auth_token, args.selector_auth_token_file, "--selector-auth-token")
    tls = (args.selector_tls_ca, args.selector_tls_cert, args.selector_tls_key, args.selector_tls_server_name)
    if not args.selector_address and (token or any(tls)):
        raise ValueError("the --selector-tls-* and --selector-auth-token* flags need --selector-address")
    return SelectorClientSettings(*tls, auth_token=token or resolve_token(args.auth_token, args.auth_token_file))


def main(argv: list[str] | None = None) -> int:
    parser = EnvDefaultsParser(prog="specdec-executor", description=__doc__)
    add_server_arguments(parser, DEFAULT_PORT)
    add_selector_client_arguments(parser)
    parser.add_argument(
        "--model-root",
        help="LoadModel paths must lie under this directory (unset: synthetic models and package:<name> GGUFs only)",
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: the first GPU, else the CPU)")
    parser.add_argument(
        "--load",
        help="a LoadModelRequest (YAML or JSON) to load at start; the server answers meanwhile (health NOT_SERVING "
        "until it is loaded and warm); the process exits 1 if the load fails, 2 if the file cannot be read",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per engine step")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests in the running batch")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    parser.add_argument(
        "--sampled-drafts",
        choices=sorted(SAMPLED_DRAFTS),
        default="auto",
        help="sampled requests' drafts drawn from the drafter's distribution (on), or its argmax (off, and auto: the "
        "faster on GPUs); both on the device step, lossless either way",
    )
    parser.add_argument(
        "--host-spec-step",
        action="store_true",
        help="verify and propose with host bookkeeping between passes, not as one device pass (for comparison)",
    )
    parser.add_argument(
        "--adaptive-speculation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each step's k (or none) from measured step times and acceptance (docs/executor.md, adaptive "
        "speculation); default: on for one CUDA GPU, off on the CPU and under tensor parallelism; off: every step "
        "verifies the drafter's k drafts",
    )
    parser.add_argument(
        "--no-overlap-decode",
        action="store_true",
        help="without a drafter, run every decode step serially instead of launching the next one before the host "
        "reads this one back (for comparison)",
    )
    parser.add_argument(
        "--no-batch-prefill-graphs",
        action="store_true",
        help="run steps of several requests without drafts (prompts arriving together, an arrival beside decodes) "
        "eagerly instead of replaying their CUDA graphs (TRITON_ATTN; docs/executor.md)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="no prefix caching for a LoadModel that leaves enable_prefix_caching unset (it may still ask for it)",
    )
    parser.add_argument(
        "--max-live-requests", type=int, default=4096, help="running + queued; more: RESOURCE_EXHAUSTED"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the target over this many GPUs (cuda:0..N-1; processes on the CPU, gloo), one process per rank",
    )
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        device = _device(args.device) if args.device else default_device()
        adaptive = args.adaptive_speculation
        if adaptive is None:
            adaptive = adaptive_by_default(device, int(args.tensor_parallel_size))
        options = ExecutorOptions(
            device=device,
            model_root=check_model_root(args.model_root) if args.model_root else None,
            selector_address=args.selector_address,
            selector_client=selector_client_settings(args),
            engine=EngineSettings(
                int(args.max_num_batched_tokens),
                int(args.max_num_seqs),
                not args.enforce_eager,
                device_spec_step=not args.host_spec_step,
                prefix_caching=not args.no_prefix_caching,
                sampled_drafts=args.sampled_drafts,
                adaptive_speculation=adaptive,
                overlap_decode=not args.no_overlap_decode,
                batch_prefill_graphs=not args.no_batch_prefill_graphs,
            ),
            max_live_requests=int(args.max_live_requests),
            tensor_parallel_size=int(args.tensor_parallel_size),
        )
        check_tensor_parallel_size(options.tensor_parallel_size)
        load = read_load_file(args.load) if args.load else None
    except (OSError, ValueError) as err:  # an unknown device, a --load file that is not a LoadModelRequest, ...
        log.error("cannot serve: %s", err)
        return EXIT_BAD_SETUP
    try:
        status = asyncio.run(serve(ServerSettings.from_args(args), options, load))
    except (OSError, ValueError) as err:  # address in use, a TLS key that is not the certificate's, ...
        log.error("cannot serve: %s", err)
        return EXIT_BAD_SETUP
    if daemon_thread.any_running():  # a model build that did not stop in time: abandon it
        log.warning("exiting with a model build still running")
        logging.shutdown()
        os._exit(status)
    return status


def read_load_file(path: str) -> LoadAtStart:
    """--load's request, read before the server starts: a file that is missing, malformed or not a
    LoadModelRequest is one line and exit 2, never a traceback from inside the running server."""
    try:
        return LoadAtStart(path, load_message(path, executor_pb2.LoadModelRequest()))  # type: ignore[arg-type]
    except (ValueError, OSError) as err:
        raise ValueError(f"--load {err}") from None


def _device(name: str) -> torch.device:
    try:
        return torch.device(name)
    except RuntimeError as err:  # torch's words: "Expected one of cpu, cuda, ... device type at start of device string"
        raise ValueError(f"--device {name!r}: {err}") from None


if __name__ == "__main__":
    sys.exit(main())
