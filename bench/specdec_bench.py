"""Speculative decoding on the GPU: pass times against their memory floors, and the end-to-end speedup.

(a) Passes at batch 1, CUDA graphs, over a context of --context tokens: one target decode step, one
    verify pass over k + 1 = 16 tokens, one EAGLE chain step (EAGLE-1 and EAGLE-3, 1 layer), one DFlash
    block pass (5 layers, block 16); or drafters of a shipped drafter's shape (--drafter-config, --drafter-layers,
    --draft-k; the JSON's `drafters` says which shapes ran). Each is timed as replayed by the engine (static-buffer
    copies + graph replay, CUDA events): issued back to back, as the chain and the engine issue them (`ms`), and
    alone on an idle GPU, which adds the host's launch latency (`alone`). Each is compared with one target
    decode step and with its own memory floor: the bytes it must move (weights it reads, KV read and
    written, logits written) over the copy bandwidth measured in the same run.
(b) End to end: tokens/s of greedy generation with a replaying test drafter (it proposes the target's own
    continuation with draft L corrupted, so each verify step emits exactly L tokens) at acceptance lengths
    1, 3, 6 and full, against target-only decoding of the same prompts in the same run; batch 1 and 16.
(c) With --tree-budget N: the target's verify pass over a tree of N drafts against the chain's over N drafts,
    eagerly, at each batch size (bench/tree_passes.py); on CUDA also one replay of the device-resident tree step
    (EAGLE-3, a dynamic top-min(8, N) tree 7 deep verifying N drafts: verify, accept, move K/V, draft the next
    tree) beside the chain's device-resident step at k = 7, batch 1, with its graph / eager counts.

(d) With --adaptive-batches: throughput at high batch (e.g. 64,128) with adaptive speculation (each step's k
    from measured costs: adaptive_k.py) against the fixed k and target-only, --repeats interleaved rounds after an
    untimed one (adaptive speculation measures its costs there, as a warm server has: an adaptive configuration
    reruns it until every candidate is measured at the batch, `AdaptiveK.measured`, `adaptive_warm_up_runs`), for
    each --e2e-methods drafter as it drafts (the synthetic drafter: acceptance ~0) and drafting the target's own
    next tokens (every draft accepted, `EchoDrafts`); only this part runs. The target's weights are made to echo
    (`echoing_target`, models/weights.py): its greedy next token is its newest, by a margin no rounding reaches, so
    the always-right drafter stays right whatever k each step takes (a random target's tokens depend on the step's
    shape in bf16: see `echoing_target`), and every run's tokens must equal target-only's (`mismatched_requests`).
    bench/tp_bench.py --drafts always-right runs the same pair under tensor parallelism.

    python bench/specdec_bench.py --out bench/results            # H100: synthetic Llama-3-8B, bf16
    python bench/specdec_bench.py --preset tiny --device cpu --backend CPU_ATTN   # a smoke run of the script
    python bench/specdec_bench.py --preset smollm2 --drafter-config dflash=drafters/smollm2-dflash --draft-k dflash=7
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "bench", REPO / "protos", REPO / "tests" / "executor"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

import torch  # noqa: E402
from common import (  # noqa: E402
    PRESETS,
    copy_bandwidth,
    default_dtype,
    log,
    make_prompts,
    median,
    provenance,
    synthetic_target,
    time_graph,
    versions,
    write_result,
)
from spec_builders import EchoDrafts, ReplayDrafts  # noqa: E402
from tree_passes import breadth_first_tree, measure_tree_verify  # noqa: E402

from executor_service.engine.request import RequestOutput  # noqa: E402
from executor_service.errors import EngineError  # noqa: E402
from executor_service.models.draft_config import METHOD_ENUMS  # noqa: E402
from executor_service.models.loader import LoadedModel, build_synthetic  # noqa: E402
from executor_service.models.weights import echoing_target  # noqa: E402
from executor_service.sample.sampling import SamplingSettings  # noqa: E402
from executor_service.server.drafting import resolve_draft  # noqa: E402
from executor_service.server.session import EngineSettings, ModelSession, build_session  # noqa: E402
from executor_service.server.validation import DEFAULT_BLOCK_SIZE  # noqa: E402
from executor_service.server.wire import (  # noqa: E402
    resolve_dtype,
    resolve_target,
    status_error,
)
from executor_service.spec_decode.adaptive_k import AdaptiveK  # noqa: E402
from specdec.v1 import common_pb2, executor_pb2  # noqa: E402
from specdec_runtime.errors import InvalidArgument  # noqa: E402

# method -> (k, drafter layers); EAGLE-3's head covers 32000 ids as the published ones do.
DRAFTERS = {"eagle": (7, 1), "eagle3": (7, 1), "dflash": (15, 5)}
ACCEPTANCE = {"1": 0, "3": 2, "6": 5, "full": None}  # acceptance length -> corrupted draft (None: none)
FLOOR_BAR = 1.4


def target_request(preset: dict[str, Any], dtype: int, backend: str, blocks: int) -> executor_pb2.LoadModelRequest:
    synthetic = synthetic_target(preset, 0)
    request = executor_pb2.LoadModelRequest(dtype=dtype, block_size=DEFAULT_BLOCK_SIZE, num_kv_blocks=blocks)
    request.enable_prefix_caching = False  # configurations rerun the same prompts: each computes its prefill
    request.target.synthetic.CopyFrom(synthetic)
    request.attention.backend = backend
    return request


@dataclass(frozen=True)
class DraftShape:
    """What a synthetic drafter's passes cost depends on: its shape (its weights' values do not matter)."""

    k: int  # drafts per step (num_speculative_tokens)
    layers: int
    intermediate: int
    draft_vocab: int = 0  # EAGLE-3's own head
    block: int = 0  # DFlash: the rows one block pass runs over, whatever k (k <= block - 1)
    mask_token_id: int = -1  # DFlash
    target_layer_ids: tuple[int, ...] = ()  # the target layers it reads (DFlash: their count sizes its fc)
    config: str = ""  # the drafter directory whose config.json gave the shape ("": DRAFTERS')


# A drafter's config.json key -> the preset's: the synthetic drafter's attention is the target's, so they must agree.
ATTENTION_KEYS = {"hidden_size": "hidden", "num_attention_heads": "heads", "num_key_value_heads": "kv_heads",
                  "head_dim": "head_size"}  # fmt: skip


def config_shape(method: str, preset: dict[str, Any], directory: Path, k: int) -> DraftShape:
    """The shape of a shipped drafter, from `directory`/config.json; ValueError if its attention is not the preset's."""
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    raw.setdefault("head_dim", raw.get("hidden_size", 0) // max(1, raw.get("num_attention_heads", 1)))
    wrong = [f"{key} {raw.get(key)} (the preset's {preset[ours]})" for key, ours in ATTENTION_KEYS.items()
             if raw.get(key) != preset[ours]]  # fmt: skip
    if wrong:
        raise ValueError(f"{path} does not fit the target preset: {', '.join(wrong)}")
    dflash = raw.get("dflash_config") or {}
    return DraftShape(
        k, raw["num_hidden_layers"], raw["intermediate_size"],
        draft_vocab=raw.get("draft_vocab_size", 0) if method == "eagle3" else 0,
        block=(dflash.get("block_size") or raw.get("block_size", 0)) if method == "dflash" else 0,
        mask_token_id=dflash.get("mask_token_id", preset["vocab"] - 1) if method == "dflash" else -1,
        target_layer_ids=tuple(dflash.get("target_layer_ids", ())) if method == "dflash" else (),
        config=str(directory),
    )  # fmt: skip


def draft_shape(
    method: str, preset: dict[str, Any], config: Path | None = None, layers: int = 0, k: int = 0
) -> DraftShape:
    """DRAFTERS' shape for `method` (DFlash: block k + 1), or a shipped drafter's from `config`/config.json;
    `layers` and `k` (0: keep) override either. Returned as the executor resolves it for the preset's target
    (its defaults filled in, so the report says what ran); InvalidArgument where the executor would refuse it."""
    k = k or DRAFTERS[method][0]
    if config is not None:
        shape = config_shape(method, preset, config, k)
    else:
        dflash = method == "dflash"
        shape = DraftShape(
            k, DRAFTERS[method][1], preset["intermediate"],
            draft_vocab=min(32000, preset["vocab"]) if method == "eagle3" else 0,
            block=k + 1 if dflash else 0, mask_token_id=preset["vocab"] - 1 if dflash else -1,
        )  # fmt: skip
    shape = replace(shape, layers=layers or shape.layers)
    try:
        target = resolve_target(target_request(preset, 0, "", 0).target, None, "target").config
        resolved = resolve_draft(draft_request(method, preset, shape), target, None).config
    except EngineError as err:  # the models' plain error (a bad field): as the executor would answer it
        raise status_error(err) from err
    return replace(
        shape, k=resolved.num_steps, draft_vocab=resolved.draft_vocab_size, block=resolved.block_size,
        mask_token_id=resolved.mask_token_id, target_layer_ids=resolved.target_layer_ids,
    )  # fmt: skip


def draft_request(method: str, preset: dict[str, Any], shape: DraftShape | None = None) -> executor_pb2.DraftModel:
    """A synthetic drafter of `shape` (default: DRAFTERS') over the preset's target."""
    shape = shape or draft_shape(method, preset)
    draft = executor_pb2.DraftModel(method=METHOD_ENUMS[method], num_speculative_tokens=shape.k)
    spec = draft.source.synthetic
    spec.architecture, spec.seed, spec.num_layers = "llama", 1, shape.layers
    spec.hidden_size, spec.intermediate_size = preset["hidden"], shape.intermediate
    spec.num_heads, spec.num_kv_heads, spec.head_size = preset["heads"], preset["kv_heads"], preset["head_size"]
    spec.draft_vocab_size = shape.draft_vocab
    if method == "dflash":
        draft.dflash_config.mask_token_id = shape.mask_token_id
        draft.dflash_config.block_size = shape.block
        draft.dflash_config.target_layer_ids.extend(shape.target_layer_ids)
    return draft


def per_method(pairs: list[str], value: Callable[[str], Any]) -> dict[str, Any]:
    """Repeated METHOD=VALUE flags as {METHOD: value(VALUE)}; ValueError names a malformed one."""
    values = {}
    for pair in pairs:
        method, _, text = pair.partition("=")
        if method not in DRAFTERS or not text:
            raise ValueError(f"{pair!r}: expected METHOD=VALUE, METHOD one of {', '.join(DRAFTERS)}")
        values[method] = value(text)
    return values


def open_session(
    args: argparse.Namespace, loaded: LoadedModel, method: str | None, preset: dict[str, Any],
    tree: common_pb2.DraftTree | None = None, depth: int = 0,
) -> ModelSession:  # fmt: skip
    request = target_request(preset, default_dtype(torch.device(args.device)), args.backend, args.kv_blocks)
    source = resolve_target(request.target, None, "target")
    draft = None
    if method is not None:
        request.draft.CopyFrom(draft_request(method, preset, args.drafters[method]))
        if tree is not None:  # the drafter's k is then the dynamic tree's depth (`depth`, else the shape's; static: 0)
            request.draft.tree.CopyFrom(tree)
            default = request.draft.num_speculative_tokens
            request.draft.num_speculative_tokens = 0 if tree.branching else depth or default
        draft = resolve_draft(request.draft, source.config, None)
    decision = common_pb2.BackendDecision(backend=args.backend)
    settings = EngineSettings(
        max_num_batched_tokens=8192, max_num_seqs=max(args.batches), cuda_graphs=True,
        adaptive_speculation=bool(args.adaptive_batches), defer_drafter_context=not args.no_defer_context,
        release_drafter=not args.no_drafter_release, batch_prefill_graphs=not args.no_batch_prefill_graphs,
    )  # fmt: skip
    started = time.perf_counter()
    session = build_session(
        source, request, decision, torch.device(args.device), settings, start=False, draft=draft,
        draft_decision=decision if draft is not None else None, preloaded=loaded,
    )  # fmt: skip
    log(f"session {method or 'target-only'}: {time.perf_counter() - started:.1f} s (load, warm-up, graphs)")
    return session


def open_sessions(args: argparse.Namespace, preset: dict[str, Any]) -> dict[str, ModelSession]:
    """Target-only and one session per drafter method, all over the same target weights."""
    device = torch.device(args.device)
    dtype = resolve_dtype(common_pb2.DTYPE_UNSPECIFIED, device)
    request = target_request(preset, 0, args.backend, args.kv_blocks)
    config = resolve_target(request.target, None, "target").config
    loaded = build_synthetic(config, 0, dtype, device)
    if args.adaptive_batches:  # (d): a target whose tokens no step shape changes (an always-right drafter)
        echoing_target(loaded.model)
    sessions: dict[str, ModelSession] = {"target-only": open_session(args, loaded, None, preset)}
    for method in args.methods:
        sessions[method] = open_session(args, loaded, method, preset)
    return sessions


# ---- (a) passes --------------------------------------------------------------------------------------------------
def time_back_to_back(run: Any, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean ms per `run()` when `iters` of them are issued back to back, as the
    drafter's chain steps and the engine's steps are: the device time of one pass."""
    for _ in range(5):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return median(times)


def graph_call(graphs: Any, blocks: list[int], context: int, inputs: dict[str, torch.Tensor]) -> Any:
    """A batch-1 call of `graphs` whose queries follow `context` cached tokens, in real cache blocks."""
    device, q, bs = graphs.positions.device, graphs.query_len, DEFAULT_BLOCK_SIZE
    positions = torch.arange(context, context + q, device=device)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(context, context + q)], device=device)
    table = torch.tensor([blocks], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([context + q], dtype=torch.int32, device=device)
    return lambda: graphs.run(table, seq_lens, slots, positions, **inputs)


def slots_ahead(blocks: list[int], context: int, width: int, device: torch.device) -> torch.Tensor:
    """[1, width] cache slots of positions context, context + 1, ...: what a proposal after `context` writes."""
    bs = DEFAULT_BLOCK_SIZE
    return torch.tensor([[blocks[p // bs] * bs + p % bs for p in range(context, context + width)]], device=device)


def parameter_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(skip))


def kv_bytes_per_token(session_cache: Any) -> int:
    storage = session_cache.storage  # [L, 2, N, bs, H, D]
    layers, _, _, _, heads, dim = storage.shape
    return 2 * layers * heads * dim * storage.element_size()


def pass_report(ms: float, bytes_moved: int, bandwidth_gbps: float, decode_ms: float) -> dict[str, Any]:
    if not bytes_moved:  # a composite pass (the device-resident step): its time only
        return {"ms": round(ms, 4), "over_target_decode": round(ms / decode_ms, 3)}
    floor_ms = bytes_moved / (bandwidth_gbps * 1e9) * 1e3
    return {
        "ms": round(ms, 4),
        "bytes_moved": bytes_moved,
        "floor_ms": round(floor_ms, 4),
        "over_floor": round(ms / floor_ms, 3),
        "within_1_4x_floor": ms / floor_ms <= FLOOR_BAR,
        "over_target_decode": round(ms / decode_ms, 3),
    }


def pass_calls(
    sessions: dict[str, ModelSession], args: argparse.Namespace, preset: dict[str, Any]
) -> dict[str, tuple[Any, int]]:
    """Each pass at batch 1 after `args.context` cached tokens: its replay callable and the bytes it must move.
    Cache blocks stay allocated for the life of the sessions (the bench ends with them)."""
    device, context = torch.device(args.device), args.context
    target = sessions["target-only"]
    model = target.loaded.model
    hidden, vocab = preset["hidden"], preset["vocab"]
    element = model.embed_tokens.weight.element_size()
    weights = parameter_bytes(model, ("embed_tokens",))  # a step reads q rows of the embedding, not the table
    per_token_kv = kv_bytes_per_token(target.kv_cache)

    def target_bytes(q: int) -> int:
        return weights + q * hidden * element + (context + q) * per_token_kv + q * vocab * 4

    def ids(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, device=device)

    def cache_blocks(session: ModelSession) -> list[int]:
        return session.kv_cache.allocator.allocate(-(-(context + 64) // DEFAULT_BLOCK_SIZE))

    blocks = cache_blocks(target)
    calls = {"target_decode": (graph_call(target.engine.runner.graphs[1], blocks, context, {"input_ids": ids(1)}),
                               target_bytes(1))}  # fmt: skip
    for method, session in sessions.items():
        proposer = session.proposer
        if proposer is None:
            continue
        runner, q = session.engine.runner, proposer.num_draft_tokens + 1
        blocks = cache_blocks(session)
        calls[f"verify_{q}_{method}"] = (graph_call(runner.graphs[q], blocks, context, {"input_ids": ids(q)}),
                                         target_bytes(q))  # fmt: skip
        drafter = proposer.drafter
        draft_kv = kv_bytes_per_token(proposer.kv_cache)
        ahead = slots_ahead(blocks, context, proposer.ahead_width, device)
        if session.engine.spec_step is not None and session.engine.spec_step.graphs:
            call = graph_call(session.engine.spec_step.graphs["greedy"], blocks, context,
                              {"input_ids": ids(q), "slots_ahead": ahead})  # fmt: skip
            calls[f"spec_step_{method}"] = (call, 0)  # verify + accept + propose, one replay: timed, no floor
        if method == "dflash":
            block = proposer.config.block_size
            inputs = {"input_ids": ids(1), "ahead_slots": ahead[:, :block]}
            call = graph_call(proposer.graphs["dflash_block"], blocks, context, inputs)
            moved = (parameter_bytes(drafter, ("fc", "hidden_norm")) + vocab * hidden * element
                     + (context + block) * draft_kv + block * hidden * element)  # fmt: skip
            calls["dflash_block_pass"] = (call, moved)
        else:
            dtype = model.embed_tokens.weight.dtype
            inputs = {"input_ids": ids(1), "hidden": torch.zeros(1, hidden, dtype=dtype, device=device),
                      "ahead_slots": ahead[:, : proposer.num_steps]}  # fmt: skip
            call = graph_call(proposer.graphs["eagle_chain"], blocks, context, inputs)
            head = 0 if method == "eagle3" else vocab * hidden * element  # EAGLE-1 reads the target's LM head
            moved = parameter_bytes(drafter) + head + (context + 1) * draft_kv + 3 * hidden * element
            calls[f"{method}_chain"] = (call, moved * (proposer.num_steps - 1))  # num_steps - 1 steps in one replay
    return calls


def measure_passes(
    sessions: dict[str, ModelSession], args: argparse.Namespace, bandwidth: float, preset: dict[str, Any]
) -> dict[str, Any]:
    device = torch.device(args.device)
    report: dict[str, Any] = {"context_tokens": args.context, "copy_GBps": bandwidth}
    calls = pass_calls(sessions, args, preset)
    times = {name: (time_back_to_back(call, args.iters), time_graph(call, device, args.iters))
             for name, (call, _) in calls.items()}  # fmt: skip
    decode_ms, decode_alone_ms = times["target_decode"]
    for name, (_, moved) in calls.items():
        ms, alone_ms = times[name]
        report[name] = pass_report(ms, moved, bandwidth, decode_ms)
        report[name]["alone"] = pass_report(alone_ms, moved, bandwidth, decode_alone_ms)
        if name.endswith("_chain"):  # one chain step: the chain's time and bytes over its num_steps - 1 steps
            steps = sessions[name.removesuffix("_chain")].proposer.num_steps - 1  # type: ignore[union-attr]
            step = pass_report(ms / steps, moved // steps, bandwidth, decode_ms)
            step["alone"] = pass_report(alone_ms / steps, moved // steps, bandwidth, decode_alone_ms)
            report[name.replace("_chain", "_draft_step")] = step
    report["ideal_speedup"] = ideal_speedups(sessions, times, decode_ms)
    return report


def ideal_speedups(
    sessions: dict[str, ModelSession], times: dict[str, tuple[float, float]], decode_ms: float
) -> dict[str, float]:
    """L * t_decode / t_step at each scripted acceptance length L, t_step being the device-resident step
    (verify + accept + propose) timed back to back: what the end-to-end speedups are compared with."""
    ideal = {}
    for method, session in sessions.items():
        if f"spec_step_{method}" not in times:
            continue
        step_ms = times[f"spec_step_{method}"][0]
        for label in ACCEPTANCE:
            ideal[f"{method}_acceptance_{label}"] = round(acceptance_length(label, session) * decode_ms / step_ms, 3)
    return ideal


def acceptance_length(label: str, session: ModelSession) -> int:
    assert session.proposer is not None
    return session.proposer.num_steps + 1 if label == "full" else int(label)


# ---- (b) end to end ----------------------------------------------------------------------------------------------
def generate(session: ModelSession, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], dict]:
    outputs: dict[str, list[RequestOutput]] = {f"p{i}": [] for i in range(len(prompts))}
    settings = SamplingSettings(max_tokens=max_tokens, ignore_eos=True)
    counts_before = pass_counts(session)
    started = time.perf_counter()
    first_output: list[float] = []  # when the prefill's tokens were handed out: decoding starts there

    def sink_of(request_id: str) -> Any:
        def sink(output: RequestOutput) -> None:
            if not first_output:
                first_output.append(time.perf_counter())
            outputs[request_id].append(output)

        return sink

    requests = [session.new_request(f"p{i}", p, settings, max_tokens, sink_of(f"p{i}")) for i, p in enumerate(prompts)]
    for request in requests:
        session.engine.add(request)
    session.engine.run_until_idle()
    ended = time.perf_counter()
    seconds = ended - started
    tokens = {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
    finishes = [outs[-1].finish for outs in outputs.values()]
    steps = sum(f.verify_steps for f in finishes if f)
    accepted = sum(f.accepted_tokens for f in finishes if f)
    total = sum(len(t) for t in tokens.values())
    passes = dict(pass_counts(session) - counts_before)
    return tokens, {
        "seconds": round(seconds, 4),
        "tokens": total,
        "tokens_per_s": round(total / seconds, 1),
        "decode_tokens_per_s": round((total - len(prompts)) / (ended - first_output[0]), 1),  # after the prefill
        "mean_acceptance_length": round(1 + accepted / steps, 3) if steps else 1.0,
        "passes": passes,  # how target steps and drafter passes ran
        "ms_per_engine_step": round(seconds * 1e3 / max(1, engine_steps(passes)), 4),
        "verify_steps_per_request": [min(r.verify_steps for r in requests), max(r.verify_steps for r in requests)],
        "preemptions": sum(r.num_preemptions for r in requests),
    }


def engine_steps(passes: dict[str, int]) -> int:
    """Each engine step runs the target once: alone (target ...) or inside the device-resident step."""
    return sum(n for name, n in passes.items() if name.startswith(("target ", "spec_step ")))


def pass_counts(session: ModelSession) -> Counter[str]:
    counts = Counter({f"target {how}": n for how, n in session.engine.runner.step_counts.items()})
    if session.engine.spec_step is not None:
        counts.update({f"spec_step {how}": n for how, n in session.engine.spec_step.counts.items()})
    if session.proposer is not None:
        counts.update(session.proposer.pass_counts)
    if session.engine.deferred is not None:  # k = 0 steps that held the drafter's context, and its flushes
        counts.update({f"drafter context {name}": n for name, n in session.engine.deferred.counts.items()})
    if session.engine.release is not None:  # requests released from a hopeless drafter, and its retries
        counts.update({f"drafter {name}": n for name, n in session.engine.release.counts.items()})
    # the engine's steps by path: "overlapped decode" (launched before the step before was read back), "host"...
    counts.update({f"engine {name}": n for name, n in session.engine.step_counts.items()})
    return counts


def profile_host(sessions: dict[str, ModelSession], args: argparse.Namespace, preset: dict[str, Any]) -> dict:
    """Where the host's time goes in the engine's steps at batch 1: cProfile of one generation per session
    (target-only, and each drafter replaying its own output at acceptance 3), the top functions by own time."""
    report = {}
    prompts = make_prompts(1, args.prompt_len, preset["vocab"] - 1, seed=1)
    for name, session in sessions.items():
        if session.proposer is not None:
            script, _ = generate(session, prompts, args.max_tokens)
            session.proposer.replay = ReplayDrafts(script, preset["vocab"], ACCEPTANCE["3"])
        generate(session, prompts, args.max_tokens)
        profiler = cProfile.Profile()
        profiler.enable()
        _, result = generate(session, prompts, args.max_tokens)
        profiler.disable()
        if session.proposer is not None:
            session.proposer.replay = None
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile_host)
        report[name] = {"ms_per_engine_step": result["ms_per_engine_step"], "top_by_own_time": text.getvalue()}
        log(f"host profile {name}: {result['ms_per_engine_step']} ms per step\n{text.getvalue()}")
    return report


def measure_end_to_end(
    sessions: dict[str, ModelSession], args: argparse.Namespace, preset: dict[str, Any], ideal: dict[str, float]
) -> dict[str, Any]:
    """Each configuration runs untimed until its replay script holds (kernels compile for new shapes), then timed.

    The replayed continuation is what the speculative target itself produces: in bf16 a verify pass (k + 1
    rows per GEMM) rounds differently from a decode step (1 row), and batches that accept differently
    round differently, so on a random 8B model a near tie can go either way and the target-only tokens
    (or another configuration's) would not give the scripted acceptance. Each configuration replays its
    own output until the script holds (`follows_its_script`)."""
    report: dict[str, Any] = {"prompt_tokens": args.prompt_len, "max_tokens": args.max_tokens}
    for batch in args.batches:
        prompts = make_prompts(batch, args.prompt_len, preset["vocab"] - 1, seed=batch)
        generate(sessions["target-only"], prompts, args.max_tokens)
        target_tokens, baseline = generate(sessions["target-only"], prompts, args.max_tokens)
        entry: dict[str, Any] = {"target_only": baseline}
        for method, session in sessions.items():
            if session.proposer is None or method not in args.e2e_methods:
                continue
            spec_tokens, drafted = generate(session, prompts, args.max_tokens)  # the synthetic drafter's drafts
            entry[f"{method}_synthetic_drafter"] = drafted | {"token_agreement_with_target_only": agreement(
                spec_tokens, target_tokens)}  # fmt: skip
            for label, wrong_at in ACCEPTANCE.items():
                script, runs = self_consistent_script(session, prompts, args.max_tokens, spec_tokens, preset, wrong_at)
                tokens, result = generate(session, prompts, args.max_tokens)
                result["follows_its_script"] = tokens == script
                result["script_held_after_runs"] = runs
                result["speedup"] = round(result["tokens_per_s"] / baseline["tokens_per_s"], 3)
                result["decode_speedup"] = round(result["decode_tokens_per_s"] / baseline["decode_tokens_per_s"], 3)
                if batch == 1 and f"{method}_acceptance_{label}" in ideal:  # passes are timed at batch 1
                    # The ideal counts decoding steps only, as the decode speedup does (no prefill).
                    share = result["decode_speedup"] / ideal[f"{method}_acceptance_{label}"]
                    result["share_of_ideal"] = round(share, 3)
                if args.host_step_too:  # the same script through the host path: verify_on_host, then propose
                    spec_step, session.engine.spec_step = session.engine.spec_step, None
                    _, host = generate(session, prompts, args.max_tokens)
                    session.engine.spec_step = spec_step
                    result["host_step_speedup"] = round(host["tokens_per_s"] / baseline["tokens_per_s"], 3)
                entry[f"{method}_acceptance_{label}"] = result
                log(f"batch {batch} {method} L={label}: {result}")
            session.proposer.replay = None
        report[f"batch_{batch}"] = entry
    return report


def self_consistent_script(
    session: ModelSession, prompts: list[list[int]], max_tokens: int, script: dict[str, list[int]],
    preset: dict[str, Any], wrong_at: int | None, tries: int = 8,
) -> tuple[dict[str, list[int]], int]:  # fmt: skip
    """Replay `script` and take the output as the next script until they agree, so the timed run replays the
    target's own tokens for these very verify batches (bf16 rounding depends on the batch's shape). Leaves
    the session replaying the script it returns, and says after how many runs it held (0: it never did)."""
    assert session.proposer is not None
    for attempt in range(1, tries + 1):
        session.proposer.replay = ReplayDrafts(script, preset["vocab"], wrong_at)
        tokens, _ = generate(session, prompts, max_tokens)
        if tokens == script:
            return script, attempt
        script = tokens
    session.proposer.replay = ReplayDrafts(script, preset["vocab"], wrong_at)
    return script, 0


def agreement(tokens: dict[str, list[int]], reference: dict[str, list[int]]) -> dict[str, Any]:
    """How far the speculative tokens follow the target-only ones: identical requests, mean common prefix."""
    prefixes = []
    for rid, ref in reference.items():
        got = tokens[rid]
        prefixes.append(next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), len(ref)))
    same = sum(tokens[rid] == ref for rid, ref in reference.items())
    return {"identical_requests": f"{same}/{len(reference)}", "mean_common_prefix": sum(prefixes) / len(prefixes)}


def tree_verify(session: ModelSession, args: argparse.Namespace) -> list[dict[str, Any]]:
    """(c): tree vs chain verify pass at each batch size; a backend without tree attention says why."""
    try:
        return [measure_tree_verify(session, b, args.context, args.tree_budget, args.iters) for b in args.batches]
    except ValueError as err:  # e.g. FLASH_ATTN: "tree attention not supported"
        return [{"refused": str(err)}]


def tree_step_times(sessions: dict[str, ModelSession], args: argparse.Namespace, preset: dict[str, Any]) -> dict:
    """(c) on CUDA: one replay of the device-resident tree step against the chain's (EAGLE-3 k = 7), batch 1
    after --context tokens, back to back; the tree's session opens here and closes after."""
    budget = args.tree_budget
    tree = common_pb2.DraftTree(top_k=min(8, budget), verify_budget=budget)
    session = open_session(args, sessions["target-only"].loaded, "eagle3", preset, tree)
    try:
        call = tree_step_call(session, args)
        if call is None:
            return {"refused": f"no tree step graphs with {args.backend}"}
        tree_ms = time_back_to_back(call, args.iters)
        report = {"shape": session.engine.spec_step.tree.describe(), "tree_step_ms": round(tree_ms, 4)}  # type: ignore[attr-defined]
        device, context = torch.device(args.device), args.context
        chain = sessions["eagle3"]
        if chain.engine.spec_step is not None and chain.engine.spec_step.graphs:
            q = chain.engine.spec_step.num_draft_tokens + 1
            chain_blocks = chain.kv_cache.allocator.allocate(-(-(context + 64) // DEFAULT_BLOCK_SIZE))
            chain_inputs = {
                "input_ids": torch.zeros(q, dtype=torch.int64, device=device),
                "slots_ahead": slots_ahead(chain_blocks, context, chain.proposer.ahead_width, device),  # type: ignore[union-attr]
            }  # fmt: skip
            chain_ms = time_back_to_back(
                graph_call(chain.engine.spec_step.graphs["greedy"], chain_blocks, context, chain_inputs), args.iters
            )
            report |= {"chain_step_ms": round(chain_ms, 4), "tree_over_chain": round(tree_ms / chain_ms, 3)}
        return report
    finally:
        session.shutdown()


def tree_step_call(session: ModelSession, args: argparse.Namespace) -> Any:
    """A batch-1 replay of the session's device-resident tree step after --context cached tokens (its tree in
    the drafted layout for a static shape, else breadth first); None without tree step graphs."""
    tree_step = session.engine.spec_step
    if tree_step is None or tree_step.tree is None or not tree_step.graphs:
        return None
    device, context, size = torch.device(args.device), args.context, tree_step.num_draft_tokens
    blocks = session.kv_cache.allocator.allocate(-(-(context + tree_step.ahead_width + 64) // DEFAULT_BLOCK_SIZE))
    inputs = {
        "input_ids": torch.zeros(tree_step.rows, dtype=torch.int64, device=device),
        "slots_ahead": slots_ahead(blocks, context, tree_step.ahead_width, device),  # from the root on
    }
    if tree_step.dynamic:  # a static tree's layout is the step's constant
        inputs["parents"] = torch.tensor([breadth_first_tree(size, min(8, size))], device=device)
    return graph_call(tree_step.graphs["greedy"], blocks, context, inputs)


# ---- (d) adaptive speculation at high batch ----------------------------------------------------------------------
WARM_UP_RUNS = 8  # at most, per adaptive configuration and batch (a candidate never measured stops it)


def measure_adaptive(sessions: dict[str, ModelSession], args: argparse.Namespace, preset: dict[str, Any]) -> dict:
    """(d): per batch, target-only, each drafter at its fixed k and adaptive (the session's AdaptiveK on and off),
    greedy; rounds interleaved, medians and spread. Every run's tokens must equal target-only's (greedy is exact,
    and the echoing target leaves no near tie: `mismatched_requests`, over the timed rounds); the chosen k per step
    is reported."""
    report: dict[str, Any] = {"prompt_tokens": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats}
    report |= {"defer_context": not args.no_defer_context, "release_drafter": not args.no_drafter_release}
    for batch in args.adaptive_batches:
        prompts = make_prompts(batch, args.prompt_len, preset["vocab"] - 1, seed=batch)
        rates: dict[str, list[float]] = {}
        decode_rates: dict[str, list[float]] = {}  # after the prefill: the steps adaptive speculation chooses for
        notes: dict[str, Any] = {}
        # One cost model per drafter and acceptance, as a server serving that traffic has (the always-right
        # drafter's acceptance would otherwise be judged on the synthetic drafter's, and the other way round).
        kinds = ("synthetic_drafter", "full")
        models = {(m, a): fresh_speculation(sessions[m]) for m in args.e2e_methods for a in kinds}
        reference: dict[str, list[int]] = {}
        warm_ups: dict[str, int] = {}  # untimed runs of each adaptive configuration before its timed rounds
        for round_index in range(args.repeats + 1):  # round 0: untimed (compiles, and adaptive measures)
            runs = [("target_only", sessions["target-only"], False, None, False)]
            for method in args.e2e_methods:
                for acceptance in kinds:
                    for fixed in (True, False):
                        name = f"{method}_{acceptance}_{'fixed_k' if fixed else 'adaptive'}"
                        runs.append((name, sessions[method], acceptance == "full", models[method, acceptance], fixed))
            for name, session, echo, model, fixed in runs:
                if session.proposer is not None:
                    session.proposer.replay = EchoDrafts() if echo else None
                session.engine.speculation = model
                with fixed_k(session, fixed):
                    tokens, result = generate(session, prompts, args.max_tokens)
                    # Untimed, adaptive: again until every candidate is measured at this batch, as on a server
                    # that has served it a while (a round of few steps, e.g. every draft accepted, ends sooner).
                    while not round_index and model is not None and not fixed and not model.measured(batch):
                        if warm_ups.setdefault(name, 1) == WARM_UP_RUNS:
                            break
                        warm_ups[name] += 1
                        tokens, result = generate(session, prompts, args.max_tokens)
                if session.proposer is not None:
                    session.proposer.replay = None
                reference = reference or tokens  # target-only's, the first run
                if round_index:
                    rates.setdefault(name, []).append(result["tokens_per_s"])
                    decode_rates.setdefault(name, []).append(result["decode_tokens_per_s"])
                    note = notes.setdefault(name, {"passes": result["passes"], "mismatched_requests": 0})
                    note.setdefault("acceptance", []).append(result["mean_acceptance_length"])
                    note["mismatched_requests"] += sum(tokens[rid] != ref for rid, ref in reference.items())
        entry: dict[str, Any] = {"target_only_tokens_per_s": sorted(rates["target_only"])}
        entry["target_only_mismatched_requests"] = notes["target_only"]["mismatched_requests"]
        for name, values in rates.items():
            if name == "target_only":
                continue
            ratios = sorted(v / b for v, b in zip(values, rates["target_only"], strict=True))
            decode = sorted(v / b for v, b in zip(decode_rates[name], decode_rates["target_only"], strict=True))
            entry[name] = {
                "tokens_per_s": sorted(values), "speedup_median": round(ratios[len(ratios) // 2], 3),
                "speedup_min": round(ratios[0], 3), "speedup_max": round(ratios[-1], 3),
                "decode_speedup_median": round(decode[len(decode) // 2], 3), **notes[name],
            }  # fmt: skip
        entry["speculation"] = {f"{m}_{a}": model.describe() for (m, a), model in models.items() if model}
        entry["adaptive_warm_up_runs"] = warm_ups
        report[f"batch_{batch}"] = entry
        log(f"adaptive batch {batch}: {json.dumps(entry)}")
    return report


def fresh_speculation(session: ModelSession) -> AdaptiveK | None:
    """A new cost model like the session's (its candidates), nothing measured yet; None where adaptive is off."""
    model = session.engine.speculation
    return AdaptiveK(model.candidates, model.num_steps, model.configured) if model is not None else None


@contextmanager
def fixed_k(session: ModelSession, fixed: bool = True) -> Iterator[None]:
    """Within it, the session's engine verifies its loaded k every step (adaptive speculation off) if `fixed`."""
    saved = session.engine.speculation
    if fixed:
        session.engine.speculation = None
    try:
        yield
    finally:
        session.engine.speculation = saved


def parse_args(description: str | None = __doc__) -> argparse.Namespace:
    """This benchmark's flags; other scripts that replay its passes (pass_profile.py) pass their own description."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="TRITON_ATTN")
    parser.add_argument("--methods", default="eagle,eagle3,dflash")
    parser.add_argument("--e2e-methods", default="eagle3,dflash")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--profile-host", type=int, default=0, help="cProfile the host at batch 1: top N functions")
    parser.add_argument("--host-step-too", action="store_true", help="also time each script on the host path")
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--tree-budget", type=int, default=0, help="time a tree verify pass of N drafts vs the chain")
    parser.add_argument("--trees", default="", help="pass_profile.py: tree specs whose device step to profile")
    parser.add_argument("--tree-method", choices=sorted(DRAFTERS), default="eagle3", help="who drafts --trees")
    parser.add_argument("--adaptive-batches", default="", help="(d) only: adaptive vs fixed k vs target-only")
    parser.add_argument("--repeats", type=int, default=3, help="(d): timed rounds, interleaved")
    parser.add_argument(
        "--no-defer-context",
        action="store_true",
        help="(d): the drafter's context pass on every k = 0 step (as before)",
    )
    parser.add_argument(
        "--no-drafter-release",
        action="store_true",
        help="(d): the drafter follows every request, even where its acceptance rules drafting out (as before)",
    )
    parser.add_argument("--prompt-lens", default="16,64,512", help="prefill_profile.py: the prompts' lengths")
    parser.add_argument(
        "--prefill-batch", type=int, default=1, help="prefill_profile.py: prompts prefilled in one step (<= --batches')"
    )
    parser.add_argument(
        "--no-batch-prefill-graphs", action="store_true", help="sessions capture no batch prefill graphs"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    shapes = parser.add_argument_group("drafter shapes (default: DRAFTERS', over the preset's MLP width)")
    for flag, metavar, text in (
        ("--drafter-config", "METHOD=DIR", "METHOD's shape from DIR/config.json (layers, MLP, EAGLE-3 head, "
         "DFlash block and mask), e.g. dflash=drafters/smollm2-dflash; its attention must be the preset's"),
        ("--drafter-layers", "METHOD=N", "METHOD's drafter layers, e.g. dflash=2 beside a 3-layer config"),
        ("--draft-k", "METHOD=K", "METHOD's drafts per step (default: eagle 7, eagle3 7, dflash 15); DFlash: at "
         "most its block - 1 (its block pass is as wide whatever k), its block k + 1 without a config"),
    ):  # fmt: skip
        shapes.add_argument(flag, action="append", default=[], metavar=metavar, help=text)
    args = parser.parse_args()
    try:  # every method's shape, also those --methods leaves out (tree sessions are EAGLE-3's)
        configs = per_method(args.drafter_config, Path)
        layers, ks = per_method(args.drafter_layers, int), per_method(args.draft_k, int)
        preset = PRESETS[args.preset]
        args.drafters = {m: draft_shape(m, preset, configs.get(m), layers.get(m, 0), ks.get(m, 0)) for m in DRAFTERS}
    except (ValueError, OSError, InvalidArgument) as err:
        parser.error(str(err))
    args.methods = [m for m in args.methods.split(",") if m]
    args.e2e_methods = [m for m in args.e2e_methods.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.adaptive_batches = [int(b) for b in args.adaptive_batches.split(",") if b]
    if args.adaptive_batches:  # the sessions' graphs and batch cover (d)'s batches
        args.batches = sorted(set(args.batches) | set(args.adaptive_batches))
        args.methods = [m for m in args.methods if m in args.e2e_methods]
    return args


def main() -> int:
    args = parse_args()
    preset = PRESETS[args.preset]
    device = torch.device(args.device)
    report: dict[str, Any] = {
        **provenance("specdec", device),
        "versions": versions(),
        "preset": args.preset,
        "backend": args.backend,
        "drafters": {m: asdict(args.drafters[m]) for m in args.methods},
    }
    report["copy_bandwidth"] = copy_bandwidth(device, preset["copy_mib"], 20)
    bandwidth = report["copy_bandwidth"]["GBps"]
    sessions = open_sessions(args, preset)
    if args.adaptive_batches:
        report["adaptive"] = measure_adaptive(sessions, args, preset)
        for session in sessions.values():
            session.shutdown()
        write_result(args.out, "specdec-adaptive", device, report["commit"], report)
        return 0
    if device.type == "cuda":
        report["passes"] = measure_passes(sessions, args, bandwidth, preset)
        log(json.dumps(report["passes"], indent=1))
    if args.profile_host:
        report["host_profile"] = profile_host(sessions, args, preset)
    if args.tree_budget:
        report["tree_verify"] = tree_verify(sessions["target-only"], args)
        log(json.dumps(report["tree_verify"], indent=1))
        if device.type == "cuda" and "eagle3" in sessions:
            report["tree_step"] = tree_step_times(sessions, args, preset)
            log(json.dumps(report["tree_step"], indent=1))
    ideal = report["passes"]["ideal_speedup"] if "passes" in report else {}
    report["end_to_end"] = measure_end_to_end(sessions, args, preset, ideal)
    for session in sessions.values():
        session.shutdown()
    gc.collect()
    write_result(args.out, "specdec", device, report["commit"], report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
