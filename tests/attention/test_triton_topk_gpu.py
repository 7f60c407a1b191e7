"""The fused log-softmax + top-k kernel (kernels/triton_topk.py) compiled on the GPU: bf16 rows of EAGLE-3's
reduced vocabulary and of a full one against a stable sort on the CPU, a CUDA graph capture replayed on new
logits, and (printed, not asserted) its time against torch's softmax + top-k + id gather, captured as graphs."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_topk import topk_log_softmax

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]

DEVICE = torch.device("cuda")


def reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.cpu()
    ids = logits.float().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return logits.double().log_softmax(-1).float().gather(1, ids), ids


@pytest.mark.parametrize(("rows", "vocab"), [(4, 8192), (48, 8192), (3, 49152)])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_bf16_rows_match_the_reference(rows: int, vocab: int, k: int) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=generator, device=DEVICE).mul(4).bfloat16()
    logits[0, 100:200] = float("-inf")
    to_target = torch.arange(vocab, device=DEVICE) * 3 + 1
    values, ids = topk_log_softmax(logits, k, to_target)
    expected_values, expected_ids = reference(logits, k)
    assert torch.equal(ids.cpu(), expected_ids * 3 + 1)
    torch.testing.assert_close(values.cpu(), expected_values, rtol=0, atol=2e-5)


def test_replays_in_a_cuda_graph() -> None:
    """Captured once on a static buffer: each replay ranks the logits copied into it since."""
    logits = torch.randn(4, 8192, device=DEVICE).bfloat16()
    topk_log_softmax(logits, 4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, ids = topk_log_softmax(logits, 4)
    for seed in range(3):
        logits.copy_(torch.randn(4, 8192, generator=torch.Generator(device=DEVICE).manual_seed(seed), device=DEVICE))
        graph.replay()
        expected_values, expected_ids = reference(logits, 4)
        assert torch.equal(ids.cpu(), expected_ids)
        torch.testing.assert_close(values.cpu(), expected_values, rtol=0, atol=2e-5)


def graph_time_us(function, calls: int = 50, replays: int = 20) -> float:
    """Mean time of one call, `calls` of them captured in one graph (as in a captured tree step: launch cost
    included, Python's left out)."""
    function()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            function()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


@pytest.mark.parametrize(("rows", "vocab", "mapped"), [(4, 8192, True), (16, 8192, True), (4, 49152, False)])
def test_time_against_torch(rows: int, vocab: int, mapped: bool) -> None:
    """Printed for the record (run with -s): EAGLE-3's 8192-entry reduced vocabulary (ids mapped), EAGLE-1's
    49152 (SmolLM2's). No assertion on time."""
    logits = torch.randn(rows, vocab, device=DEVICE).bfloat16()
    to_target = torch.arange(vocab, device=DEVICE) + 7 if mapped else None

    def torch_path() -> None:
        _, ids = logits.log_softmax(-1, dtype=torch.float32).topk(4, dim=-1)
        if to_target is not None:
            to_target[ids]

    fused = graph_time_us(lambda: topk_log_softmax(logits, 4, to_target))
    reference_us = graph_time_us(torch_path)
    print(f"\n[{rows}, {vocab}] k=4 mapped={mapped}: fused {fused:.2f} us, torch {reference_us:.2f} us")
