"""Who owns TRITON_ATTN's split-KV counters (kernels/split_combine.py) in the executor: an eager step makes one
buffer at its first layer and every later layer reuses it; nothing is made while a graph is being captured; a
graph set hands every bucket's step its one static buffer; a proposer's static buffer is made once and handed only
to passes it has room for. The attention itself is checked against CPU_ATTN with the combine kernel counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_service.models import attention_step
from executor_service.models.attention_step import STATIC_SPLIT_HEADS, AttentionStep, build_attention_step
from executor_service.runner.cuda_graphs import StepGraphs
from executor_service.spec_decode.proposer import Proposer
from kernels import unavailable_reason
from kernels.testing import BatchSpec, make_paged_batch

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 6, 2, 32, 16
SEQ_LEN = 300  # one request of 2 KV heads on the CPU's 8 "SMs": choose_config splits it 4 ways (3 parts used)


def decode_step(backend: str) -> tuple[AttentionStep, torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = BatchSpec("decode", (SEQ_LEN,), (1,))
    batch = make_paged_batch(spec, HEADS, KV_HEADS, HEAD_SIZE, BLOCK, torch.float32, CPU)
    blocks = batch.block_table[0, : -(-SEQ_LEN // BLOCK)].tolist()
    step = build_attention_step(backend, [blocks], [1], [SEQ_LEN], [-1], True, CPU)
    return step, batch.q, batch.k_cache, batch.v_cache


@pytest.fixture
def combine_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from kernels import triton_attn

    launches: list[int] = []
    original = triton_attn.combine_splits
    monkeypatch.setattr(triton_attn, "combine_splits", lambda *a, **k: (launches.append(1), original(*a, **k)))
    return launches


@pytest.mark.skipif(unavailable_reason("TRITON_ATTN", CPU) is not None, reason="triton unavailable")
def test_an_eager_step_makes_one_buffer_for_its_layers(combine_launches: list[int]) -> None:
    step, q, k_cache, v_cache = decode_step("TRITON_ATTN")
    assert step.split_counters is None
    first = step.attend(q, k_cache, v_cache, HEAD_SIZE**-0.5)
    counters = step.split_counters
    assert counters is not None and counters.numel() == 1 * HEADS and not counters.any()
    second = step.attend(q, k_cache, v_cache, HEAD_SIZE**-0.5)  # the next layer
    assert step.split_counters is counters and not counters.any()
    assert not combine_launches, "the split call combined in its one kernel"
    reference, *_ = decode_step("CPU_ATTN")
    expected = reference.attend(q, k_cache, v_cache, HEAD_SIZE**-0.5)
    torch.testing.assert_close(first, expected, atol=2e-4, rtol=2e-4)
    assert torch.equal(first, second)
    assert reference.split_counters is None, "only TRITON_ATTN reads them"


@pytest.mark.skipif(unavailable_reason("TRITON_ATTN", CPU) is not None, reason="triton unavailable")
def test_nothing_is_made_while_capturing(monkeypatch: pytest.MonkeyPatch, combine_launches: list[int]) -> None:
    """Under a capture the step keeps None, and the call falls back to the combine kernel (the control: the same
    call combined in one kernel above)."""
    monkeypatch.setattr(attention_step, "_capturing", lambda device: True)
    step, q, k_cache, v_cache = decode_step("TRITON_ATTN")
    step.attend(q, k_cache, v_cache, HEAD_SIZE**-0.5)
    assert step.split_counters is None and len(combine_launches) == 1


def test_graphs_hand_every_bucket_their_static_buffer() -> None:
    seen: list[torch.Tensor | None] = []

    def forward(step: AttentionStep, positions: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple:
        seen.append(step.split_counters)
        return (inputs["x"] * 2,)

    graphs = StepGraphs("test", forward, "TRITON_ATTN", 1, 8, 64, BLOCK, CPU, {"x": ((), torch.float32)})
    assert graphs.split_counters.numel() == graphs.max_batch * STATIC_SPLIT_HEADS and not graphs.split_counters.any()
    graphs.capture()
    graphs.replay(torch.zeros(3, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), x=torch.ones(3))
    assert len(seen) > len(graphs.buckets) and all(c is graphs.split_counters for c in seen)


def test_a_proposer_makes_its_buffer_once() -> None:
    """Graphs captured with the buffer keep its address: a second, larger reservation must not replace it."""
    proposer = SimpleNamespace(split_counters=None, device=CPU)
    Proposer.reserve_split_counters(proposer, 4)  # type: ignore[arg-type]
    counters = proposer.split_counters
    assert counters is not None and counters.numel() == 4 * STATIC_SPLIT_HEADS and not counters.any()
    Proposer.reserve_split_counters(proposer, 16)  # type: ignore[arg-type]
    assert proposer.split_counters is counters
    assert Proposer.counters_for(proposer, 4) is counters  # type: ignore[arg-type]
    assert Proposer.counters_for(proposer, 5) is None  # type: ignore[arg-type]  # an eager step makes its own
