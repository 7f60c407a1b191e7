"""How much memory a LoadModel needs, estimated from the configs before anything is allocated, and how
much this device has to give.

LoadModel refuses a model that does not fit (RESOURCE_EXHAUSTED with the estimate and what is available)
instead of letting the allocator fail halfway, or the host swap and the OOM killer pick a victim. The
estimate is deliberately on the high side: every weight, RoPE table and KV block, the largest tensor's
staging copy while loading, one step's activations at the full token budget, the speculative step's penalty
table, and a fixed margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.engine.kv_cache import bytes_per_block
from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import DraftConfig
from executor_service.models.draft_weights import draft_layout
from executor_service.models.weights import Placement, hf_layout
from executor_service.runner.prefill_graphs import (
    batch_prefill_requests,
    prefill_buckets,
    prefill_graph_rows,
    request_buckets,
)
from executor_service.sample.sampling import MAX_LOGIT_BIAS
from executor_service.spec_decode.deferred_context import DEFER_MAX
from executor_service.spec_decode.step_variants import DEFAULT_PENALTY_SLOTS
from specdec_runtime.errors import FieldViolation, ResourceExhausted

CPU_MEMORY_FRACTION = 0.75  # of MemAvailable: the rest stays for the OS, the other processes and our own heap
CPU_MARGIN_BYTES = 256 << 20  # interpreter, allocator slack, tokenizer
CUDA_MARGIN_BYTES = 2 << 30  # CUDA graphs' pools, the caching allocator's slack, kernels' workspaces
# Logits in fp32, their probabilities (or log-probabilities), and a penalised copy (penalties.py, which works
# in passes of ROWS_PER_PASS rows, so its own temporaries stay small).
LOGITS_COPIES = 3
# The decode sampler's graphs, captured at load on CUDA (engine/sampler_graphs.py) and kept: their static inputs
# (an fp32 row of logits per sequence) and the sorted draw's intermediates in their pool (the sort's values and
# int64 indices, the probabilities and their running sum, the log-probabilities), in fp32 rows a sequence.
SAMPLER_ROW_COPIES = 8
ACTIVATION_WIDTHS = 8  # hidden-sized tensors alive at once in a layer (residual, norms, attention out, ...)
# The device steps' penalty table (device_penalties.PenaltyTable): per slot (one per running request, and a
# scratch slot) and vocabulary entry, a bool (in the prompt) and an int32 (output count); per slot, the logit bias
# (MAX_LOGIT_BIAS int64 ids and float32 values).
PENALTY_TABLE_BYTES_PER_ENTRY = 1 + 4
LOGIT_BIAS_BYTES_PER_SLOT = MAX_LOGIT_BIAS * (8 + 4)
# The CUDA caching allocator's segments, which a graph's pool keeps whole (empty ones too: the graph replays into
# them). A prefill-graph pool of SmolLM2's shape kept 3 small segments, and its static inputs one more outside it
# (H200, torch.cuda.memory_snapshot); one more for margin.
LARGE_SEGMENT_BYTES = 20 << 20
SMALL_SEGMENT_BYTES = 2 << 20
POOL_SMALL_SEGMENTS = 5


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int  # target and drafter parameters, RoPE tables, the staging copy of the largest tensor
    kv_cache: int  # the target's and the drafter's KV blocks
    activations: int  # one step at the full token budget, and the fixed margin

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    def describe(self) -> str:
        return (
            f"{size_text(self.total)} (weights {size_text(self.weights)}, KV cache {size_text(self.kv_cache)}, "
            f"activations and margin {size_text(self.activations)})"
        )


def size_text(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / 2**30:.1f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def estimate_memory(
    target: ModelConfig,
    draft: DraftConfig | None,
    dtype: torch.dtype,
    num_kv_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    device: torch.device,
    batch_prefill_graphs: bool = True,
) -> MemoryEstimate:
    """What loading `target` (and `draft`) with a cache of `num_kv_blocks` takes on `device` (`batch_prefill_graphs`:
    EngineSettings')."""
    element = torch.empty((), dtype=dtype).element_size()
    layouts = [hf_layout(target)] + ([draft_layout(draft)] if draft is not None else [])
    parameters = sum(_numel(p) for layout in layouts for p in layout.values())
    largest = max(_numel(p) for layout in layouts for p in layout.values())
    models = [target] + ([draft.model] if draft is not None else [])
    rope = sum(2 * model.max_position_embeddings * (model.head_size // 2) * 4 for model in models)
    weights = parameters * element + rope + 2 * largest * 4  # staged in fp32 (a GGUF dequantizes, then converts)
    kv_cache = num_kv_blocks * sum(bytes_per_block(model, block_size, dtype) for model in models)
    tokens = max_num_batched_tokens
    rows = min(tokens, max_num_seqs * ((draft.num_draft_tokens if draft is not None else 0) + 1))
    activations = _step_bytes(target, tokens, element) + rows * target.vocab_size * 4 * LOGITS_COPIES
    if draft is not None:
        draft_tokens = max_num_seqs * max(draft.positions_ahead, 1)
        activations += _step_bytes(draft.model, draft_tokens, element)
        features = feature_bytes(target, draft, element)
        activations += tokens * features
        activations += max_num_seqs * DEFER_MAX * features  # the drafter's context held at k = 0
        rows = max_num_seqs * (draft.block_size if draft.method == "dflash" else 1)  # EAGLE: one row per chain step
        activations += rows * (draft.draft_vocab_size or target.vocab_size) * 4 * LOGITS_COPIES
        activations += penalty_table_bytes(max_num_seqs, target.vocab_size)  # the speculative step's
    if device.type == "cuda":  # the decode sampler's graphs and their penalty table, captured at load
        activations += max_num_seqs * target.vocab_size * 4 * SAMPLER_ROW_COPIES
        # the prefill graphs' rows, at the longest model length a LoadModel may ask for
        rows = prefill_graph_rows(max_num_batched_tokens, target.parameter_count(), target.max_position_embeddings)
        activations += prefill_graph_bytes(target, draft, rows, element)
        if batch_prefill_graphs:
            activations += batch_prefill_graph_bytes(target, draft, rows, max_num_seqs, element)
        if draft is not None:
            activations += draft_prefill_graph_bytes(target, draft, rows, element)
            if batch_prefill_graphs:
                activations += draft_batch_prefill_graph_bytes(target, draft, rows, max_num_seqs, element)
        activations += penalty_table_bytes(DEFAULT_PENALTY_SLOTS, target.vocab_size) + CUDA_MARGIN_BYTES
    else:
        activations += CPU_MARGIN_BYTES
    return MemoryEstimate(weights, kv_cache, activations)


def prefill_graph_bytes(target: ModelConfig, draft: DraftConfig | None, graph_rows: int, element: int) -> int:
    """The lone-prefill graphs' pool, kept (runner/prefill_graphs.py): a layer's transients at the largest bucket's
    rows, the drafter's features of those rows, the last row's logits, every bucket's static per-row inputs; in the
    caching allocator's segments (`_in_segments`). `graph_rows`: prefill_graph_rows'."""
    buckets = prefill_buckets(graph_rows)
    if not buckets:
        return 0
    rows = buckets[-1]
    features = feature_bytes(target, draft, element)
    static = sum(buckets) * 3 * 8  # input ids, positions, slots: int64
    tensors = _step_bytes(target, rows, element) + rows * features + target.vocab_size * 4 * LOGITS_COPIES + static
    return _in_segments(tensors)


def batch_prefill_graph_bytes(
    target: ModelConfig, draft: DraftConfig | None, graph_rows: int, max_num_seqs: int, element: int
) -> int:
    """The batch prefill graphs' own memory (runner/prefill_graphs.py; their transients reuse the lone prefill
    graphs' pool): per bucket of rows, float32 logits of its largest request bucket and its rows' features, shared by
    its graphs, and their static inputs (ids, positions, slots a row; a block table and four ints a request)."""
    row = feature_bytes(target, draft, element) + 3 * 8
    return _varlen_graph_bytes(target, graph_rows, max_num_seqs, row, target.vocab_size * 4)


def draft_prefill_graph_bytes(target: ModelConfig, draft: DraftConfig, graph_rows: int, element: int) -> int:
    """The drafter's lone-request context-pass graphs' pool, kept (Proposer.capture_prefill_graphs): its layer's
    transients at the largest bucket's rows and its two outputs a row (EAGLE's feedback and head), every bucket's
    static per-row inputs (the target's features, ids, positions, slots), in the allocator's segments."""
    buckets = prefill_buckets(graph_rows)
    if not buckets:
        return 0
    rows, hidden = buckets[-1], draft.model.hidden_size
    features = feature_bytes(target, draft, element)
    static = sum(buckets) * (3 * 8 + features)
    return _in_segments(_step_bytes(draft.model, rows, element) + 2 * rows * hidden * element + static)


def draft_batch_prefill_graph_bytes(
    target: ModelConfig, draft: DraftConfig, graph_rows: int, max_num_seqs: int, element: int
) -> int:
    """The drafter's several-request context-pass graphs' own memory (Proposer.capture_batch_prefill_graphs; their
    transients reuse its lone graphs' pool): per bucket of rows, its rows' static inputs (the target's features,
    ids, positions, slots) and two outputs a row (EAGLE's feedback and head), a block table and four ints a request
    of its largest request bucket."""
    row = feature_bytes(target, draft, element) + 2 * draft.model.hidden_size * element + 4 * 8
    return _varlen_graph_bytes(target, graph_rows, max_num_seqs, row, 0)


def _varlen_graph_bytes(target: ModelConfig, graph_rows: int, max_num_seqs: int, row: int, request: int) -> int:
    """Batch graphs' own memory (prefill_graphs.VarlenGraphs): per bucket of rows, `row` bytes a row, and for each
    request of its largest request bucket `request` bytes, a block table and four ints; in the allocator's segments."""
    max_requests = batch_prefill_requests(max_num_seqs)
    blocks = -(-target.max_position_embeddings // 16) + 1  # a block table row at the smallest block size, roughly
    total = 0
    for rows in prefill_buckets(graph_rows):
        top = request_buckets(max_requests, rows)[-1]
        total += rows * row + top * (request + blocks * 4 + 4 * 8)
    return _in_segments(total) if total else 0


def feature_bytes(target: ModelConfig, draft: DraftConfig | None, element: int) -> int:
    """The bytes of a target row's features that the drafter reads (the captured layers' hidden states; none
    without a drafter)."""
    return (len(draft.target_layer_ids) or 1) * target.hidden_size * element if draft is not None else 0


def _in_segments(num_bytes: int) -> int:
    """What the caching allocator reserves for a graph pool of `num_bytes` of tensors and its static inputs:
    tensors of 1-10 MiB are cut from 20 MiB segments, smaller ones from 2 MiB ones."""
    return -(-num_bytes // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES + POOL_SMALL_SEGMENTS * SMALL_SEGMENT_BYTES


def penalty_table_bytes(slots: int, vocab: int) -> int:
    """A PenaltyTable of `slots` (and its scratch slot): counts and prompt marks per id, and its logit biases."""
    return (slots + 1) * (vocab * PENALTY_TABLE_BYTES_PER_ENTRY + LOGIT_BIAS_BYTES_PER_SLOT)


def _numel(placement: Placement) -> int:
    return math.prod(placement.shape)


def _step_bytes(config: ModelConfig, tokens: int, element: int) -> int:
    """One layer's transient tensors for `tokens` tokens (layers run one after another)."""
    width = ACTIVATION_WIDTHS * config.hidden_size + config.q_size + 2 * config.kv_size + 3 * config.intermediate_size
    return tokens * width * element


def available_bytes(device: torch.device, fraction: float) -> int:
    """What a new model may take now: on CUDA, `fraction` of the device's memory less what is in use; on the
    CPU, CPU_MEMORY_FRACTION of the host's available memory (MemAvailable)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * fraction) - (total - free)
    return int(host_available_bytes() * CPU_MEMORY_FRACTION)


def available_text(device: torch.device, fraction: float) -> str:
    if device.type == "cuda":
        return f"free within gpu_memory_utilization {fraction:g} of {device}"
    return f"{CPU_MEMORY_FRACTION:.0%} of the host's available memory"


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable (Linux): free memory plus what the kernel can reclaim without swapping. Elsewhere the
    free physical pages."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fits_beside(
    estimate: MemoryEstimate, device: torch.device, fraction: float, resident: MemoryEstimate | None
) -> bool:
    """True: build the new model beside the resident one (`resident`: the loaded model's estimate, None for
    none). False: it fits only once the resident model is released. ResourceExhausted when it fits in neither
    case, with the estimate and what is available."""
    available = available_bytes(device, fraction)
    if estimate.total <= available:
        return True
    if resident is not None and estimate.total <= available + resident.total:
        return False
    largest = max(("target", estimate.weights), ("num_kv_blocks", estimate.kv_cache), key=lambda item: item[1])[0]
    room = f"{size_text(max(available, 0))} available ({available_text(device, fraction)})"
    if resident is not None:
        room += f", {size_text(resident.total)} more once the loaded model is released"
    raise ResourceExhausted(
        f"the model needs an estimated {estimate.describe()}, more than the {room}",
        field_violations=(FieldViolation(largest, f"needs an estimated {size_text(estimate.total)}, over {room}"),),
    )
