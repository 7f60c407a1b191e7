"""LoadModel's memory estimate covers the speculative step's penalty table (device_penalties.PenaltyTable), which
graphs allocate at capture: per running request and vocabulary entry, as many bytes as the table really takes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from executor_builders import load_request
from spec_builders import draft_model

from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import DraftConfig
from executor_service.server import memory
from executor_service.server.drafting import resolve_draft
from executor_service.server.memory import PENALTY_TABLE_BYTES_PER_ENTRY, estimate_memory
from executor_service.server.wire import resolve_target
from executor_service.spec_decode.deferred_context import DEFER_MAX, DeferredContext
from executor_service.spec_decode.device_penalties import PenaltyTable
from executor_service.spec_decode.step_variants import DEFAULT_PENALTY_SLOTS


def test_the_penalty_table_takes_what_the_estimate_counts() -> None:
    table = PenaltyTable(slots=3, vocab=17, device=torch.device("cpu"))
    table.allocate()
    assert table.in_prompt is not None and table.output is not None
    assert table.in_prompt.nbytes + table.output.nbytes == (3 + 1) * 17 * PENALTY_TABLE_BYTES_PER_ENTRY


def eagle3_estimate() -> tuple[ModelConfig, DraftConfig, Callable[[], int]]:
    """A synthetic target of 512 ids with an EAGLE-3 drafter, and the estimate's activation bytes for it (fp32,
    40 running requests)."""
    request = load_request()
    request.draft.CopyFrom(draft_model("eagle3", 3, 7, 512))
    request.target.synthetic.vocab_size = 512
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None).config

    def activations() -> int:
        args = (source.config, draft, torch.float32, 64, 16, 64, 40, torch.device("cpu"))
        return estimate_memory(*args).activations

    return source.config, draft, activations


def test_the_estimate_counts_a_table_slot_per_running_request(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, activations = eagle3_estimate()
    with_table = activations()
    monkeypatch.setattr(memory, "PENALTY_TABLE_BYTES_PER_ENTRY", 0)
    assert with_table - activations() == (40 + 1) * 512 * PENALTY_TABLE_BYTES_PER_ENTRY


def test_the_estimate_counts_the_held_drafter_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adaptive speculation's k = 0 steps hold DEFER_MAX feature rows per running request (deferred_context.py):
    the buffer the store allocates is what the estimate adds."""
    target, draft, activations = eagle3_estimate()
    with_buffer = activations()
    monkeypatch.setattr(memory, "DEFER_MAX", 0)
    width = len(draft.target_layer_ids) * target.hidden_size
    store = DeferredContext(max_num_seqs=40)
    store._buffer_like(torch.zeros(1, width))
    assert store._buffer is not None
    assert with_buffer - activations() == store._buffer.nbytes == 40 * DEFER_MAX * width * 4


def test_on_cuda_the_estimate_counts_the_drafters_prefill_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a drafter, a CUDA load's estimate adds its context pass's prefill-graph pool to the target's."""
    target, draft, _ = eagle3_estimate()
    cuda = torch.device("cuda")

    def activations() -> int:
        return estimate_memory(target, draft, torch.float32, 64, 16, 64, 40, cuda).activations

    with_drafters, pool = activations(), memory.draft_prefill_graph_bytes(target, draft, 64, 4)
    monkeypatch.setattr(memory, "draft_prefill_graph_bytes", lambda *args: 0)
    assert with_drafters - activations() == pool >= memory.LARGE_SEGMENT_BYTES


def test_with_a_drafter_the_estimate_counts_its_batch_context_graphs_where_they_are_on() -> None:
    """The drafter's several-request context-pass graphs (Proposer.capture_batch_prefill_graphs) come with the
    target's batch prefill graphs: their rows' static inputs and outputs are counted beside the target's."""
    target, draft, _ = eagle3_estimate()
    cuda = torch.device("cuda")
    off = estimate_memory(target, draft, torch.float32, 64, 16, 64, 40, cuda, batch_prefill_graphs=False).activations
    on = estimate_memory(target, draft, torch.float32, 64, 16, 64, 40, cuda).activations
    drafter = memory.draft_batch_prefill_graph_bytes(target, draft, 64, 40, 4)
    assert on - off == memory.batch_prefill_graph_bytes(target, draft, 64, 40, 4) + drafter
    features, outputs = memory.feature_bytes(target, draft, 4), 2 * draft.model.hidden_size * 4
    assert drafter >= (16 + 32 + 64) * (features + outputs)


def test_the_estimate_counts_batch_prefill_graphs_where_they_are_on() -> None:
    request = load_request()
    config = resolve_target(request.target, None, "target").config
    cuda = torch.device("cuda")
    off = estimate_memory(config, None, torch.float32, 64, 16, 64, 40, cuda, batch_prefill_graphs=False).activations
    on = estimate_memory(config, None, torch.float32, 64, 16, 64, 40, cuda).activations  # on by default
    batch_prefill = memory.batch_prefill_graph_bytes(config, None, 64, 40, 4)
    assert on - off == batch_prefill >= (16 + 32 + 33) * 512 * 4  # rows 16, 32, 64: 16, 32, 33 requests' logits


def test_on_cuda_the_estimate_counts_the_sampler_graphs_static_inputs() -> None:
    """The decode sampler's graphs are captured at load on CUDA: the estimate counts SAMPLER_ROW_COPIES fp32 rows of
    logits a running request there (not on the CPU, which has no graphs), at least the static inputs they keep, and
    their penalty table, as many bytes as it takes; and the lone-prefill graphs' pool (its GPU test measures it)."""
    from executor_service.engine.sampler_graphs import SamplerGraphs

    request = load_request()
    request.target.synthetic.vocab_size = 512
    config = resolve_target(request.target, None, "target").config

    def activations(device: str) -> int:  # the batch prefill graphs apart (the test above counts them)
        on = torch.device(device)
        return estimate_memory(config, None, torch.float32, 64, 16, 64, 40, on, batch_prefill_graphs=False).activations

    margins = memory.CUDA_MARGIN_BYTES - memory.CPU_MARGIN_BYTES
    table = PenaltyTable(DEFAULT_PENALTY_SLOTS, 512, torch.device("cpu"))
    table.allocate()
    tensors = (table.in_prompt, table.output, table.bias_ids, table.bias_values)
    table_bytes = sum(t.nbytes for t in tensors if t is not None)
    assert memory.penalty_table_bytes(DEFAULT_PENALTY_SLOTS, 512) == table_bytes
    prefill = memory.prefill_graph_bytes(config, None, 64, 4)  # 64 rows: buckets 16, 32, 64
    tensors = memory._step_bytes(config, 64, 4) + 512 * 4 * memory.LOGITS_COPIES + (16 + 32 + 64) * 24
    small = memory.POOL_SMALL_SEGMENTS * memory.SMALL_SEGMENT_BYTES
    assert tensors < memory.LARGE_SEGMENT_BYTES and prefill == memory.LARGE_SEGMENT_BYTES + small
    sampler = activations("cuda") - activations("cpu") - margins - table_bytes - prefill
    assert sampler == 40 * 512 * 4 * memory.SAMPLER_ROW_COPIES
    graphs = SamplerGraphs(max_batch=40)
    inputs = graphs._inputs(40, torch.zeros(1, 512))
    assert sampler >= sum(t.nbytes for t in inputs.values())
