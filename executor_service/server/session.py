"""A loaded model ready to serve: weights, KV cache, scheduler and a running engine, plus the backend
decision it runs on. LoadModel builds one in steps that the servicer interleaves with its event loop:
resolve the source, ask for backends, then load and warm up in a worker thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from executor_service.cancellation import check_cancelled
from executor_service.engine.engine import Engine, StepObserver, VerifyObserver
from executor_service.engine.kv_cache import KVCache, blocks_for_memory_fraction, blocks_needed
from executor_service.engine.prefix_cache import PrefixCache, PrefixCacheStats, tokens_after_block
from executor_service.engine.request import Request, RequestOutput, Sink
from executor_service.engine.scheduler import Scheduler, speculative_headroom
from executor_service.load_phases import LoadPhases
from executor_service.models.chat import load_chat_template
from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import METHOD_ENUMS, DraftConfig, feature_layers
from executor_service.models.draft_weights import check_drafter_checkpoint
from executor_service.models.gguf_loader import hf_name, is_gguf, open_gguf, tensor_shapes
from executor_service.models.limits import MAX_NUM_KV_BLOCKS
from executor_service.models.loader import LoadedModel, check_directory, check_tensors
from executor_service.models.model_loading import TargetSource, load_target
from executor_service.models.weights import hf_layout
from executor_service.parallel.driver import TensorParallelModel, allocate_on_all_ranks, load_on_all_ranks
from executor_service.parallel.estimate import rank_zero_estimate
from executor_service.parallel.layers import rank_config
from executor_service.parallel.loading import load_target_shard
from executor_service.parallel.state import get_tp_group, tensor_parallel_size
from executor_service.runner.cuda_graphs import GRAPH_BACKENDS
from executor_service.runner.eager_warm_up import warm_up_models
from executor_service.runner.model_runner import ModelRunner
from executor_service.runner.prefill_graphs import BATCH_PREFILL_BACKENDS, batch_prefill_requests, prefill_graph_rows
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.backend_claims import DRAFT_FIELD, TARGET_FIELD, check_backend_claims
from executor_service.server.drafting import DraftSource, build_drafter, speculative_config
from executor_service.server.memory import MemoryEstimate, estimate_memory
from executor_service.server.validation import DEFAULT_BLOCK_SIZE, ModelLimits, shard_violations
from executor_service.server.wire import DTYPE_ENUMS, resolve_dtype
from executor_service.spec_decode.adaptive_k import AdaptiveK, PlanObserver
from executor_service.spec_decode.dflash_proposer import DFlashProposer
from executor_service.spec_decode.eagle_proposer import EagleProposer
from executor_service.spec_decode.proposer import Proposer
from executor_service.spec_decode.spec_step import SpecStep
from specdec.v1 import common_pb2, executor_pb2, selector_pb2
from specdec_runtime.errors import FieldViolation, ResourceExhausted, invalid_fields

log = logging.getLogger("specdec.executor")

CPU_DEFAULT_KV_TOKENS = 16384
MAX_SPEC_GRAPH_BATCH = 32  # verify/draft graphs hold logits for batch x (k + 1) rows per bucket
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
WARM_UP_PROMPT_TOKENS = 32
WARM_UP_MAX_TOKENS = 3
SAMPLED_DRAFTS: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class EngineSettings:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs where the backend allows
    device_spec_step: bool = True  # greedy verify + accept + propose as one device pass (spec_step.py)
    prefix_caching: bool = True  # for a LoadModel that leaves enable_prefix_caching unset (prefix_cache.py)
    sampled_drafts: str = "auto"  # sampled requests' drafts: "on" drawn from q, "off" argmax, "auto" (proposer.py)
    # Each step's k (or none) from measured costs (adaptive_k.py); off: the loaded k every step. It changes no token
    # (greedy and point-mass sampled verification emit target-only decoding's tokens whatever k), but the drafted /
    # accepted counts follow the measured step times. The server's default is `adaptive_by_default`'s; sessions
    # built directly (tests, benchmarks) ask for it.
    adaptive_speculation: bool = False
    # Steps without drafting (adaptive speculation's k = 0) hold the drafter's context for a batched pass later
    # (deferred_context.py); off: its context pass runs every such step.
    defer_drafter_context: bool = True
    # With adaptive speculation, requests are released from a drafter whose measured acceptance rules drafting out,
    # new ones followed again now and then (drafter_release.py); off: the drafter follows every request.
    release_drafter: bool = True
    # Without a drafter, steady decode steps launch the step after them before the host reads them back, so the host's
    # booking overlaps the device (engine/overlap_decode.py); off: every decode step serially.
    overlap_decode: bool = True
    # Steps of several requests without drafts (prefills arriving together, or beside decodes) replay CUDA graphs of
    # their rows and requests (runner/prefill_graphs.py, BATCH_PREFILL_BACKENDS); off: they run eagerly.
    batch_prefill_graphs: bool = True


def adaptive_by_default(device: torch.device, tensor_parallel_size: int) -> bool:
    """The server's adaptive speculation when its command line leaves it unset: on where the model runs on one CUDA
    GPU, where it was measured at or above the loaded k's speed and near target-only's where the drafter loses
    (docs/executor.md, adaptive speculation); off on the CPU (the demo shows every step's drafts, and a shared
    host's step times are noise) and under tensor parallelism (not measured there)."""
    return device.type == "cuda" and tensor_parallel_size == 1


def selection_request(
    request: executor_pb2.LoadModelRequest,
    config: ModelConfig,
    hardware: common_pb2.HardwareCapabilities,
    dtype: torch.dtype,
    draft: DraftSource | None = None,
) -> selector_pb2.SelectBackendsRequest:
    """What the selector decides from: this machine's report, the target's layer spec and the drafter's."""
    block_size = request.block_size or DEFAULT_BLOCK_SIZE
    speculative = (
        speculative_config(draft, request.draft, DTYPE_ENUMS[dtype], block_size) if draft is not None else None
    )
    return selector_pb2.SelectBackendsRequest(
        hardware=hardware,
        target_layers=common_pb2.LayerSpec(
            head_size=config.head_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            dtype=DTYPE_ENUMS[dtype],
            kv_cache_dtype="auto",
            block_size=block_size,
            **tensor_parallel_shapes(config),
        ),
        attention=request.attention,
        speculative=speculative,
    )


def tensor_parallel_shapes(config: ModelConfig) -> dict[str, int]:
    """The target's LayerSpec fields for tensor parallelism: the ranks and the heads each rank's kernel runs
    (none at size 1; sizes that do not divide are left for the selector to refuse with its reason)."""
    size = tensor_parallel_size()
    if size == 1:
        return {}
    shapes = {"tensor_parallel_size": size}
    if config.num_heads % size == 0 and config.num_kv_heads % size == 0:
        shapes.update(num_heads_per_rank=config.num_heads // size, num_kv_heads_per_rank=config.num_kv_heads // size)
    return shapes


@dataclass
class ModelSession:
    loaded: LoadedModel
    decision: common_pb2.BackendDecision
    dtype: torch.dtype
    kv_cache: KVCache
    engine: Engine
    limits: ModelLimits
    info: executor_pb2.ModelInfo
    load_seconds: float = 0.0
    draft_decision: common_pb2.BackendDecision | None = None
    proposer: Proposer | None = None
    memory: MemoryEstimate | None = None  # what LoadModel estimated it takes (None: built without an estimate)

    def new_request(
        self,
        request_id: str,
        prompt: list[int],
        settings: SamplingSettings,
        max_tokens: int,
        sink: Sink,
        num_draft_tokens: int | None = None,
    ) -> Request:
        """`num_draft_tokens`: the request's own drafts verified per step (GenerateRequest.num_speculative_tokens),
        checked by check_generate (None: the drafter's; 0: no drafting; a chain's first drafts, a tree's first
        nodes). Its drafter lookahead follows from it (DraftConfig.lookahead)."""
        proposer, own = self.proposer, num_draft_tokens
        most = proposer.num_draft_tokens if proposer is not None else 0
        own = most if own is None else min(own, most)
        return Request(
            request_id=request_id,
            prompt_ids=prompt,
            settings=settings,
            max_tokens=max_tokens,
            eos_token_ids=frozenset(self.loaded.config.eos_token_ids),
            sink=sink,
            num_draft_tokens=own,
            num_lookahead_tokens=proposer.config.lookahead(own) if proposer is not None else 0,
        )

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache lookups since the load (GetLoads, metrics); all zero with prefix caching off."""
        prefix_cache = self.engine.scheduler.prefix_cache
        return prefix_cache.stats() if prefix_cache is not None else PrefixCacheStats()

    def shutdown(self) -> None:
        self.engine.shutdown()
        if isinstance(self.engine.runner.model, TensorParallelModel):  # the other ranks drop their shards
            self.engine.runner.model.release()


def requested_kv_blocks(request: executor_pb2.LoadModelRequest, device: torch.device) -> int | None:
    """The KV cache's blocks as the request sets them (the CPU's default when 0); None on CUDA with 0: sized
    from the memory left once the weights are loaded."""
    if request.num_kv_blocks > 0:
        return request.num_kv_blocks
    if device.type == "cuda":
        return None
    return blocks_needed(CPU_DEFAULT_KV_TOKENS, request.block_size or DEFAULT_BLOCK_SIZE)


def warm_up_tokens(config: ModelConfig, draft: DraftSource | None) -> tuple[int, int]:
    """The longest warm-up request's prompt, and the KV slots it needs with the speculative step's drafts
    and lookahead: no cache may be smaller, or the warm-up (and every request after it) could never run."""
    prompt = max(1, min(WARM_UP_PROMPT_TOKENS, config.max_position_embeddings - WARM_UP_MAX_TOKENS - 1))
    ahead = draft.config.num_draft_tokens + draft.config.positions_ahead if draft is not None else 0
    return prompt, prompt + WARM_UP_MAX_TOKENS + ahead


def check_warm_up_fits(
    num_blocks: int, block_size: int, config: ModelConfig, draft: DraftSource | None, requested: bool
) -> None:
    """INVALID_ARGUMENT on num_kv_blocks (`requested`) or RESOURCE_EXHAUSTED (sized from free memory) for a
    cache that cannot hold one warm-up request."""
    prompt, needed = warm_up_tokens(config, draft)
    if num_blocks * block_size >= needed:
        return
    ahead = needed - prompt - WARM_UP_MAX_TOKENS
    why = (
        f"{num_blocks} blocks of {block_size} tokens hold {num_blocks * block_size}; one warm-up request needs "
        f"{needed} ({prompt} prompt + {WARM_UP_MAX_TOKENS} generated + {ahead} for the speculative step): "
        f"at least {blocks_needed(needed, block_size)} blocks"
    )
    if requested:
        raise invalid_fields([FieldViolation("num_kv_blocks", why)])
    raise ResourceExhausted(f"the memory left for the KV cache is too small: {why}")


def prepare_load(
    source: TargetSource,
    request: executor_pb2.LoadModelRequest,
    draft: DraftSource | None,
    device: torch.device,
    settings: EngineSettings,
) -> MemoryEstimate:
    """Every check that allocates nothing, done before the loaded model is put at risk: the checkpoints'
    tensors (names and shapes, from their headers), the KV cache against the warm-up; then the estimate of
    the memory the build takes."""
    violations = shard_violations(source.config, tensor_parallel_size(), "target")
    if violations:
        raise invalid_fields(violations)
    if source.path is not None and is_gguf(source.path):
        shapes = tensor_shapes(open_gguf(source.path, "target.path"))
        check_tensors(hf_layout(source.config), {hf_name(n): s for n, s in shapes.items()}, "target.path")
    elif source.path is not None:
        check_directory(source.path, source.config, "target.path")
    if draft is not None and draft.path is not None:
        check_drafter_checkpoint(draft.path, draft.config, "draft.source.path")
    block_size = request.block_size or DEFAULT_BLOCK_SIZE
    num_blocks = requested_kv_blocks(request, device)
    if num_blocks is not None:
        check_warm_up_fits(num_blocks, block_size, source.config, draft, request.num_kv_blocks > 0)
    else:  # sized after the weights: at least what the warm-up needs
        num_blocks = blocks_needed(warm_up_tokens(source.config, draft)[1], block_size)
    dtype = resolve_dtype(request.dtype, device)
    whole = estimate_memory(
        source.config,
        draft.config if draft is not None else None,
        dtype,
        num_blocks,
        block_size,
        settings.max_num_batched_tokens,
        settings.max_num_seqs,
        device,
        settings.batch_prefill_graphs,
    )
    size = tensor_parallel_size()  # rank 0's share: its device decides
    return rank_zero_estimate(whole, source.config, draft is not None, dtype, num_blocks, block_size, size)


def build_session(
    source: TargetSource,
    request: executor_pb2.LoadModelRequest,
    decision: common_pb2.BackendDecision,
    device: torch.device,
    settings: EngineSettings,
    on_step: StepObserver | None = None,
    start: bool = True,
    draft: DraftSource | None = None,
    draft_decision: common_pb2.BackendDecision | None = None,
    on_verify: VerifyObserver | None = None,
    preloaded: LoadedModel | None = None,
    memory: MemoryEstimate | None = None,
    on_plan: PlanObserver | None = None,
    before_warm_up: Callable[[ModelSession], None] | None = None,
) -> ModelSession:
    """Load weights (and the drafter's), size and allocate the KV caches, warm the kernels up, capture
    graphs, start the engine thread (`start=False`: the caller drives `engine.run_until_idle()` itself,
    as deterministic tests do). `preloaded`: target weights already loaded (benchmarks pairing one target
    with several drafters). `memory`: the estimate it was admitted with (prepare_load), kept on the session.
    `on_plan(k)`: each step's k chosen by adaptive speculation (metrics). `before_warm_up(session)`: benchmarks
    script the drafter there (Proposer.device_replay), before the graphs capture the device step.
    Under `cancellation.cancellable`, it stops (LoadCancelled) between tensors, phases and warm-up steps."""
    started = time.perf_counter()
    phases = LoadPhases()
    dtype = resolve_dtype(request.dtype, device)
    block_size = request.block_size or DEFAULT_BLOCK_SIZE
    check_backend_claims(decision.backend, source.config, dtype, block_size, device, TARGET_FIELD)
    if draft is not None and draft_decision is not None:
        check_backend_claims(draft_decision.backend, draft.config.model, dtype, block_size, device, DRAFT_FIELD)
    num_blocks = requested_kv_blocks(request, device)
    if num_blocks is not None:  # before anything is allocated
        check_warm_up_fits(num_blocks, block_size, source.config, draft, request.num_kv_blocks > 0)
    tp_group, heads = get_tp_group(), None
    phases.enter("target weights")
    if preloaded is not None:
        loaded = preloaded
    elif tp_group is not None:  # every rank loads it and keeps its shard; rank 0 keeps the drafter's heads
        whole = partial(load_target, source, dtype, device)
        shard = partial(load_target_shard, source.path, whole, dtype, device, 0, tp_group.world_size, draft is not None)
        loaded, heads = load_on_all_ranks(tp_group, request.SerializeToString(), decision.backend, shard)
    else:
        loaded = load_target(source, dtype, device)
    config = loaded.config
    check_cancelled()
    phases.enter("drafter weights")
    drafter = build_drafter(draft, heads or loaded.model, dtype, device) if draft is not None else None  # type: ignore[arg-type]
    draft_model = [draft.config.model] if draft is not None else []
    check_cancelled()
    phases.enter("KV cache and engine")
    if num_blocks is None:
        fraction = request.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        shapes = rank_config(config, tp_group.world_size) if tp_group is not None else config
        num_blocks = blocks_for_memory_fraction([shapes, *draft_model], block_size, dtype, device, fraction)
        most = blocks_needed(settings.max_num_seqs * config.max_position_embeddings, block_size)
        num_blocks = min(num_blocks, most, MAX_NUM_KV_BLOCKS)
        check_warm_up_fits(num_blocks, block_size, config, draft, requested=False)
    if isinstance(loaded.model, TensorParallelModel):  # each rank's cache holds its own KV heads
        kv_cache = KVCache(rank_config(config, loaded.model.group.world_size), num_blocks, block_size, dtype, device)
        allocate_on_all_ranks(loaded.model, num_blocks, block_size)
    else:
        kv_cache = KVCache(config, num_blocks, block_size, dtype, device)
    max_model_len = config.max_position_embeddings
    proposer = None
    if drafter is not None:
        assert draft is not None and draft_decision is not None, "a drafter is loaded with its backend decision"
        draft_cache = KVCache(draft.config.model, num_blocks, block_size, dtype, device, kv_cache.allocator)
        proposer = proposer_class(draft.config)(drafter, draft_cache, draft_decision.backend, max_model_len, device)
        proposer.sample_drafts = SAMPLED_DRAFTS[settings.sampled_drafts]
    layers = feature_layers(draft.config) if draft is not None else None
    runner = ModelRunner(loaded.model, kv_cache, decision.backend, device, layers)
    lookahead = draft.config.positions_ahead if draft is not None else 0
    prefix_cache = None
    if request.enable_prefix_caching if request.HasField("enable_prefix_caching") else settings.prefix_caching:
        after = tokens_after_block(draft.config.method if draft is not None else None)
        prefix_cache = PrefixCache(kv_cache.allocator, block_size, after)
    batch = settings.max_num_batched_tokens, settings.max_num_seqs
    scheduler = Scheduler(kv_cache.allocator, block_size, *batch, lookahead, max_model_len, prefix_cache)
    slots = settings.max_num_seqs  # every running request may set a penalty (device_penalties.py)
    speculation = None
    if proposer is not None and settings.adaptive_speculation:
        graphs = settings.cuda_graphs and device.type == "cuda" and decision.backend in GRAPH_BACKENDS
        speculation = adaptive_speculation(proposer, graphs)
        speculation.observer = on_plan
    spec_step = device_step(runner, proposer, slots, settings.device_spec_step)
    engine = Engine(
        runner, scheduler, max_model_len, on_step, proposer, on_verify, spec_step, speculation,
        defer_context=settings.defer_drafter_context, overlap_decode=settings.overlap_decode,
        release_drafter=settings.release_drafter,
    )  # fmt: skip
    headroom = speculative_headroom(draft.config.num_draft_tokens, lookahead) if draft is not None else 0
    chat = load_chat_template(source.path, config, loaded.tokenizer)
    limits = ModelLimits(
        config.vocab_size, max_model_len, kv_cache.capacity_tokens, loaded.tokenizer is not None, headroom,
        chat_template=chat,
        num_draft_tokens=draft.config.num_draft_tokens if draft is not None else 0,
        headroom_by_draft_tokens=headroom_by_draft_tokens(draft.config) if draft is not None else (),
    )  # fmt: skip
    info = executor_pb2.ModelInfo(
        architecture=config.architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_size=config.head_size,
        max_model_len=max_model_len,
        dtype=DTYPE_ENUMS[dtype],
        block_size=block_size,
        num_kv_blocks=num_blocks,
        spec_method=METHOD_ENUMS[draft.config.method] if draft is not None else common_pb2.SPEC_METHOD_NONE,
        # GetServerInfo's num_speculative_tokens: the drafts verified per step (a tree's node count)
        num_speculative_tokens=draft.config.num_draft_tokens if draft is not None else 0,
        has_tokenizer=loaded.tokenizer is not None,
        eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else -1,
        has_chat_template=chat is not None and chat.compiled is not None,
        prefix_caching=prefix_cache is not None,
    )
    session = ModelSession(
        loaded, decision, dtype, kv_cache, engine, limits, info, 0.0, draft_decision, proposer, memory
    )
    if before_warm_up is not None:
        before_warm_up(session)
    phases.enter("warm-up")
    warm_up(session)
    if settings.cuda_graphs and device.type == "cuda":  # with TP: every rank captures (parallel/graphs.py)
        phases.enter("CUDA graphs")
        capture_graphs(session, settings, max_model_len)
    if device.type == "cuda":  # eager passes' kernels, compiled now rather than on a caller's step
        phases.enter("eager kernels")
        warm_up_models(engine.runner, proposer, max_model_len, settings.max_num_seqs)
        if engine.overlap is not None:
            engine.overlap.capture_sampler()
    check_cancelled()
    if start:
        engine.start()
    phases.finish()
    session.load_seconds = time.perf_counter() - started
    return session


def proposer_class(config: DraftConfig) -> type[Proposer]:
    """One proposer per drafting method, for its chains and trees alike."""
    return DFlashProposer if config.method == "dflash" else EagleProposer


def device_step(runner: ModelRunner, proposer: Proposer | None, penalty_slots: int, wanted: bool) -> SpecStep | None:
    """The speculative step on the device for the proposer's drafts, chains or trees, under tensor parallelism too
    (None: the host path runs every step)."""
    if proposer is None or not wanted:
        return None
    return SpecStep(runner, proposer, penalty_slots)


def adaptive_speculation(proposer: Proposer, graphs: bool) -> AdaptiveK:
    """The num_draft_tokens a step may take: none, and the loaded drafter's; every count in between too where no
    verify graphs are captured (no graph is captured at run time). A tree is verified whole or not at all (its
    depth, num_steps, is what the acceptance per depth measures)."""
    size = proposer.num_draft_tokens
    if proposer.tree is not None:
        return AdaptiveK((0, size), num_steps={size: proposer.num_steps}, configured=size)
    return AdaptiveK((0, size) if graphs else range(size + 1), configured=size)


def headroom_by_draft_tokens(draft: DraftConfig) -> tuple[int, ...]:
    """speculative_headroom of a request verifying 0, 1, ..., num_draft_tokens per step (per-request
    speculation)."""
    return tuple(speculative_headroom(n, draft.lookahead(n)) for n in range(draft.num_draft_tokens + 1))


def capture_graphs(session: ModelSession, settings: EngineSettings, max_model_len: int) -> None:
    """Target decode, verify and lone-prefill graphs, and the drafter's (its chain or block, its context pass's
    one-row and lone-request graphs), where each one's backend can be captured.
    Under tensor parallelism the target's decode and verify graphs are captured on every rank, and replayed in
    lockstep (parallel/graphs.py); the drafter's on rank 0 alone (it involves no other rank)."""
    runner, proposer = session.engine.runner, session.proposer
    spec_batch = min(settings.max_num_seqs, MAX_SPEC_GRAPH_BATCH)
    parameters = session.loaded.config.parameter_count()
    prefill_rows = prefill_graph_rows(settings.max_num_batched_tokens, parameters, max_model_len)
    max_requests = batch_prefill_requests(settings.max_num_seqs)
    # The host path's tree steps run eagerly but for the context pass: decode graphs, and the device step's
    # (spec_step.capture_graphs).
    if proposer is not None and proposer.tree is not None:
        if proposer.backend in GRAPH_BACKENDS:
            capture_context_graphs(proposer, settings, prefill_rows, max_requests)
        proposer = None
    if session.decision.backend in GRAPH_BACKENDS:
        runner.capture_graphs([1], settings.max_num_seqs, max_model_len)
        if proposer is not None:
            runner.capture_graphs([proposer.num_draft_tokens + 1], spec_batch, max_model_len)
        if not isinstance(runner.model, TensorParallelModel):  # prefill_graphs.py: rank 0's alone
            runner.capture_prefill_graphs(prefill_rows, max_model_len)
            if settings.batch_prefill_graphs and runner.backend in BATCH_PREFILL_BACKENDS:
                runner.capture_batch_prefill_graphs(prefill_rows, max_requests, max_model_len)
    if proposer is not None and proposer.backend in GRAPH_BACKENDS:
        proposer.capture_graphs(spec_batch, settings.max_num_seqs)
        capture_context_graphs(proposer, settings, prefill_rows, max_requests)  # on rank 0, as its other graphs
    spec_step = session.engine.spec_step
    if spec_step is not None and {session.decision.backend, spec_step.proposer.backend} <= GRAPH_BACKENDS:
        spec_step.capture_graphs(spec_batch, max_model_len)


def capture_context_graphs(proposer: Proposer, settings: EngineSettings, rows: int, max_requests: int) -> None:
    """The drafter's context-pass graphs: a lone request's, and several requests' where the batch prefill graphs
    are on and its backend skips requests without rows (BATCH_PREFILL_BACKENDS)."""
    proposer.capture_prefill_graphs(rows)
    if settings.batch_prefill_graphs and proposer.backend in BATCH_PREFILL_BACKENDS:
        proposer.capture_batch_prefill_graphs(rows, max_requests)


def warm_up(session: ModelSession) -> None:
    """Run a prefill and a few decode steps (a mixed batch) before serving: kernels compile now, not on
    the first caller's time. Runs on the caller's thread before the engine thread starts; bounded in steps
    (a stalled scheduler fails the load instead of spinning) and cancellable between steps."""
    outputs: list[RequestOutput] = []
    prompt_len = warm_up_tokens(session.loaded.config, None)[0]
    lengths = (prompt_len, max(1, prompt_len // 3))
    for index, length in enumerate(lengths):
        prompt = [1 % session.limits.vocab_size] * length
        request = session.new_request(f"warmup-{index}", prompt, SamplingSettings(), WARM_UP_MAX_TOKENS, outputs.append)
        session.engine.add(request)
    max_steps = 64 + 8 * (sum(lengths) + len(lengths) * WARM_UP_MAX_TOKENS)

    def before_step(step: int) -> None:
        check_cancelled()
        if step >= max_steps:
            raise RuntimeError(f"warm-up did not finish in {max_steps} engine steps")  # an engine bug

    # Not served work: its tokens, drafts and steps (kernel compilation included) stay out of the metrics.
    # Its steps compile kernels: the speculation does not time them (the loaded k serves the warm-up).
    engine = session.engine
    observers = engine.on_step, engine.on_verify, engine.speculation
    engine.on_step = engine.on_verify = engine.speculation = None
    try:
        engine.run_until_idle(before_step)
    finally:
        engine.on_step, engine.on_verify, engine.speculation = observers
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise errors[0]
    if session.kv_cache.allocator.num_used:
        raise RuntimeError("warm-up leaked KV blocks")  # an engine bug: refuse to serve with it
    if engine.scheduler.prefix_cache is not None:  # its prompts are no caller's: start with an empty cache
        engine.scheduler.prefix_cache.reset()
