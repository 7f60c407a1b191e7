"""The Executor gRPC service: an asyncio shell over the engine thread.

Handlers never touch the device: loading runs in a worker thread, generation hands requests to the
engine and awaits their tokens on an asyncio queue that the engine thread fills thread-safely.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from executor_service.cancellation import LoadCancelled, cancellable
from executor_service.daemon_thread import in_daemon_thread
from executor_service.engine.prefix_cache import PrefixCacheStats
from executor_service.engine.request import RequestOutput
from executor_service.errors import EngineError
from executor_service.parallel.state import RankUnavailable, check_ranks_alive
from executor_service.sample.sampling import SamplingSettings
from executor_service.server import memory
from executor_service.server.capabilities import probe
from executor_service.server.drafting import check_drafter_backend, resolve_draft
from executor_service.server.generate_stream import GenerateStream
from executor_service.server.mailbox import Mailbox
from executor_service.server.metrics import EngineMetrics
from executor_service.server.prompt_intake import check_prompt
from executor_service.server.selection import BackendChooser
from executor_service.server.server_info import LoadCounters, loads, server_info
from executor_service.server.session import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineSettings,
    ModelSession,
    build_session,
    prepare_load,
    requested_kv_blocks,
    selection_request,
)
from executor_service.server.validation import check_load_request, has_drafter
from executor_service.server.wire import Unavailable, resolve_dtype, resolve_target, status_error
from specdec.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from specdec_runtime.errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    ResourceExhausted,
    SpecdecError,
)

STREAM_FLUSH_SECONDS = 5.0
LOAD_CANCEL_WAIT_S = 2.0  # how long shutdown waits for a LoadModel under way to notice it is cancelled (then: os._exit)
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
log = logging.getLogger("specdec.executor")


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(
        self,
        device: torch.device,
        model_root: Path | None,
        chooser: BackendChooser,
        engine_settings: EngineSettings,
        metrics: EngineMetrics,
        set_serving: Callable[[bool], Awaitable[None]],
        max_live_requests: int = 4096,
    ) -> None:
        self.device, self.model_root, self.chooser = device, model_root, chooser
        self.engine_settings, self.metrics, self.set_serving = engine_settings, metrics, set_serving
        self.max_live_requests = max_live_requests
        self.session: ModelSession | None = None
        self.draining = False
        self.open_streams = 0  # Generate streams not yet closed
        self._stream_outputs: dict[str, asyncio.Queue[RequestOutput]] = {}  # by request id: ranks_failed's reach
        self._mailbox: Mailbox | None = None
        self._capabilities: common_pb2.HardwareCapabilities | None = None
        self.counters = LoadCounters()  # GetServerInfo's uptime, GetLoads' totals and tokens/s
        self._load_lock = asyncio.Lock()
        self._cancel_load: threading.Event | None = None  # set: the LoadModel under way stops (shutdown)
        metrics.watch(
            queue_depth=lambda: len(self.session.engine.scheduler.waiting) if self.session else 0,
            running=lambda: len(self.session.engine.scheduler.running) if self.session else 0,
            kv_used=lambda: self.session.kv_cache.allocator.num_used if self.session else 0,
            kv_total=lambda: self.session.kv_cache.num_blocks if self.session else 0,
        )
        metrics.watch_prefix_cache(lambda: self.session.prefix_cache_stats() if self.session else PrefixCacheStats())

    async def capabilities(self) -> common_pb2.HardwareCapabilities:
        if self._capabilities is None:
            self._capabilities = await asyncio.to_thread(probe, self.device)
        return self._capabilities

    async def GetCapabilities(
        self, request: executor_pb2.GetCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.HardwareCapabilities:
        return await self.capabilities()

    async def LoadModel(
        self, request: executor_pb2.LoadModelRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.LoadModelResponse:
        try:
            return await self.load(request)
        except SpecdecError as err:
            await context.abort_with_status(err.to_status())
            raise
        except grpc.aio.AioRpcError as err:  # the selector's answer, passed on with its details
            await context.abort(err.code(), err.details() or "", tuple(err.trailing_metadata() or ()))
            raise

    async def load(self, request: executor_pb2.LoadModelRequest) -> executor_pb2.LoadModelResponse:
        """Check, choose backends, estimate, build and warm up the new model beside the loaded one, then swap.

        The loaded model serves until the new one is ready, so a load that fails leaves it serving. Only when
        the new model fits in memory just in place of the old one is the old one released first, after every
        check that allocates nothing has passed. At the swap, the old model's streams still running end with
        finish_reason "abort" (as they always have when a model is replaced). An engine error (no room for the
        KV cache, a tensor-parallel rank gone) leaves as its status error."""
        try:
            return await self._checked_load(request)
        except EngineError as err:
            raise status_error(err) from err

    async def _checked_load(self, request: executor_pb2.LoadModelRequest) -> executor_pb2.LoadModelResponse:
        check_load_request(request)
        check_ranks_alive()
        if self.draining:
            raise Unavailable("the executor is shutting down")
        if self._load_lock.locked():
            raise FailedPrecondition("another LoadModel is in progress")
        async with self._load_lock:
            self._cancel_load = threading.Event()
            try:
                return await self._load(request, self._cancel_load)
            finally:
                self._cancel_load = None

    async def _load(
        self, request: executor_pb2.LoadModelRequest, cancel: threading.Event
    ) -> executor_pb2.LoadModelResponse:
        if self.session is not None and self.session.engine.num_live:
            raise FailedPrecondition(
                f"{self.session.engine.num_live} requests are running on the loaded model; abort them first"
            )
        source = await asyncio.to_thread(resolve_target, request.target, self.model_root, "target")
        draft = None
        if has_drafter(request):
            draft = await asyncio.to_thread(resolve_draft, request.draft, source.config, self.model_root)
        hardware = await self.capabilities()
        dtype = resolve_dtype(request.dtype, self.device)
        decision = await self.chooser.choose(selection_request(request, source.config, hardware, dtype, draft))
        if draft is not None:
            check_drafter_backend(draft.config, decision.drafter.backend)
        estimate = await asyncio.to_thread(prepare_load, source, request, draft, self.device, self.engine_settings)
        fraction = request.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        resident = self.session.memory if self.session is not None else None
        beside = memory.fits_beside(estimate, self.device, fraction, resident)
        if self.session is not None and (not beside or requested_kv_blocks(request, self.device) is None):
            await self._release()  # it fits only in place of the old one (or takes what memory is left)
        log.info("building the model", extra={"source": _source_name(request), "estimate": estimate.describe()})
        try:
            session = await in_daemon_thread(
                "specdec-load",
                _build_cancellable,
                cancel,
                source,
                request,
                decision.target,
                self.device,
                self.engine_settings,
                self._on_step,
                draft=draft,
                draft_decision=decision.drafter if draft is not None else None,
                on_verify=self.metrics.on_verify,
                on_plan=self.metrics.on_plan,
                memory=estimate,
            )
        except LoadCancelled:
            raise Unavailable("the executor is shutting down: the model being loaded was dropped") from None
        except (torch.OutOfMemoryError, MemoryError) as err:
            raise ResourceExhausted(
                f"out of memory while building the model (estimated {estimate.describe()}): {str(err)[:200]}"
            ) from None
        if self.draining:  # shutdown began while it was built: serve nothing new
            await asyncio.to_thread(session.shutdown)
            raise Unavailable("the executor is shutting down: the model being loaded was dropped")
        try:
            check_ranks_alive()  # a rank lost after its build: health must not turn SERVING again
        except RankUnavailable:
            await asyncio.to_thread(session.shutdown)
            raise
        old, self.session = self.session, session
        await self.set_serving(True)
        if old is not None:
            await asyncio.to_thread(old.shutdown)
        log.info(
            "model loaded",
            extra={
                "source": session.loaded.source,
                "backend": decision.target.backend,
                "draft_backend": decision.drafter.backend if draft is not None else None,
                "kv_blocks": session.kv_cache.num_blocks,
                "seconds": round(session.load_seconds, 2),
            },
        )
        return executor_pb2.LoadModelResponse(
            target_backend=decision.target, draft_backend=session.draft_decision, info=session.info
        )

    async def _release(self) -> None:
        """Stop serving the loaded model and free its memory (its running streams end with "abort")."""
        old, self.session = self.session, None
        await self.set_serving(False)
        if old is None:
            return
        await asyncio.to_thread(old.shutdown)
        del old
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # so that the free memory the next model is sized from includes it

    async def GetModelInfo(
        self, request: executor_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.GetModelInfoResponse:
        session = self.session
        if session is None:
            await context.abort_with_status(_not_loaded().to_status())
        assert session is not None
        return executor_pb2.GetModelInfoResponse(
            info=session.info, target_backend=session.decision, draft_backend=session.draft_decision
        )

    async def Generate(
        self, request: executor_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.GenerateResponse]:
        try:
            session, outputs = await self._admit(request)
        except (SpecdecError, EngineError) as err:
            await context.abort_with_status(status_error(err).to_status())
            return
        stream = GenerateStream(request.request_id, session.loaded.tokenizer, request.sampling.stop)
        finished = stopping = False
        self.open_streams += 1
        self._stream_outputs[request.request_id] = outputs
        try:
            while not finished:
                chunk = [await outputs.get()]
                while not outputs.empty():  # coalesce what piled up while we were sending
                    chunk.append(outputs.get_nowait())
                error = next((o.error for o in chunk if o.error is not None), None)
                # The engine's own failures (a request the cache can never hold, a tensor-parallel rank gone) end
                # the stream with their kind's status and field; anything else is a bug: INTERNAL.
                if isinstance(error, EngineError):
                    await context.abort_with_status(status_error(error).to_status())
                if error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {error}")
                response = stream.response(chunk)
                finished = stream.finished
                if stream.stopped and not finished and not stopping:  # a stop string: the engine stops it
                    stopping = True
                    session.engine.abort([request.request_id])
                if response is not None:
                    yield response
        finally:
            self.open_streams -= 1
            if self._stream_outputs.get(request.request_id) is outputs:
                del self._stream_outputs[request.request_id]
            if not finished:  # client cancelled or the stream broke: stop the work, free the blocks
                session.engine.abort([request.request_id])

    async def _admit(self, request: executor_pb2.GenerateRequest) -> tuple[ModelSession, asyncio.Queue[RequestOutput]]:
        session, (prompt, settings, max_tokens) = await self._checked(request)
        if session.engine.is_live(request.request_id):
            raise _already_running(request.request_id)
        if session.engine.num_live >= self.max_live_requests:
            raise ResourceExhausted(
                f"{session.engine.num_live} requests in flight; the limit is {self.max_live_requests}"
            )
        if self._mailbox is None:
            self._mailbox = Mailbox(asyncio.get_running_loop())
        mailbox = self._mailbox
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:  # called on the engine thread
            mailbox.post(outputs, output)

        # The wire's num_speculative_tokens on Generate is the request's own num_draft_tokens (drafts per step).
        own = request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        engine_request = session.new_request(request.request_id, prompt, settings, max_tokens, sink, own)
        try:
            session.engine.add(engine_request)
        except KeyError:  # the same id was added between the check above and here
            raise _already_running(request.request_id) from None
        self.counters.on_admit(len(prompt))
        return session, outputs

    async def _checked(
        self, request: executor_pb2.GenerateRequest
    ) -> tuple[ModelSession, tuple[list[int], SamplingSettings, int]]:
        """The loaded session and the request checked against it (a long prompt off the event loop); checked
        again if a LoadModel replaced the model meanwhile."""
        while True:
            session = self.session
            if self.draining:
                raise Unavailable("the executor is shutting down")
            check_ranks_alive()  # before "not loaded": a rank lost during a LoadModel is what the caller must hear
            if session is None:
                raise _not_loaded()
            checked = await check_prompt(request, session.limits, session.loaded.tokenizer)
            if self.session is session and not self.draining:
                return session, checked

    def ranks_failed(self, reason: str) -> None:
        """On the event loop, when tensor parallelism breaks (launcher.py's watchdog): every open stream ends with
        UNAVAILABLE now, though the engine thread may still wait inside a collective that will never meet."""
        error = RankUnavailable(f"tensor parallelism is broken: {reason}; restart the executor")
        for request_id, outputs in list(self._stream_outputs.items()):
            outputs.put_nowait(RequestOutput(request_id, [], error=error))

    async def Abort(
        self, request: executor_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.AbortResponse:
        session = self.session
        aborted = session.engine.abort(request.request_ids) if session is not None else []
        return executor_pb2.AbortResponse(aborted_request_ids=aborted)

    async def GetServerInfo(
        self, request: executor_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.GetServerInfoResponse:
        capabilities = await self.capabilities()
        max_batch = self.engine_settings.max_num_seqs
        return server_info(self.counters, capabilities, self.session, max_batch, self.max_live_requests)

    async def GetLoads(
        self, request: executor_pb2.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.GetLoadsResponse:
        session = self.session
        return loads(self.counters, session, session.prefix_cache_stats() if session is not None else None)

    def _on_step(self, computed: int, generated: int, seconds: float) -> None:
        """The engine thread's step observer: the Prometheus metrics and GetLoads' counters."""
        self.metrics.on_step(computed, generated, seconds)
        self.counters.on_step(computed, generated, seconds)

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new generations, let running ones finish for `grace_seconds`, then abort the rest (their
        streams end with finish_reason "abort"), and stop the engine."""
        self.draining = True
        if self._cancel_load is not None:  # a LoadModel under way stops at its next check; new ones are refused
            self._cancel_load.set()
        try:
            await asyncio.wait_for(self._load_lock.acquire(), LOAD_CANCEL_WAIT_S)
            self._load_lock.release()
        except TimeoutError:  # still in a long step of the build (its thread is a daemon: it cannot hold us up)
            log.warning(
                "the LoadModel under way did not stop within %s s; shutting down without it", LOAD_CANCEL_WAIT_S
            )
        session = self.session
        if session is None:
            return
        deadline = time.monotonic() + grace_seconds
        while session.engine.num_live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if session.engine.num_live:
            log.info("aborting %d requests at shutdown", session.engine.num_live)
            session.engine.abort(session.engine.live_ids())
        deadline = time.monotonic() + STREAM_FLUSH_SECONDS
        while self.open_streams and time.monotonic() < deadline:  # their final "abort" messages go out
            await asyncio.sleep(0.01)
        await asyncio.to_thread(session.shutdown)


def _build_cancellable(cancel: threading.Event, *args: Any, **kwargs: Any) -> ModelSession:
    """build_session on this thread, stopped (LoadCancelled) once `cancel` is set."""
    with cancellable(cancel):
        return build_session(*args, **kwargs)


def _source_name(request: executor_pb2.LoadModelRequest) -> str:
    return request.target.path[:200] if request.target.WhichOneof("source") == "path" else "synthetic"


def _already_running(request_id: str) -> AlreadyExists:
    return AlreadyExists(
        f"request_id {request_id!r} is already running",
        field_violations=(FieldViolation("request_id", "already running; ids must be unique"),),
    )


def _not_loaded() -> FailedPrecondition:
    return FailedPrecondition("no model is loaded: call LoadModel first")
