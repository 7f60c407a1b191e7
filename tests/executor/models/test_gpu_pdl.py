"""Programmatic dependent launch (kernels/pdl.py) changes when a kernel starts, never what it computes.

A SmolLM2-shaped model on the fused path (every GEMM, the attention and its split combine built with PDL) runs a
stretch of decode steps as replays of one CUDA graph, a different token and position written in place before
each, and must give the same logits at every step, bit for bit, as the same graph with PDL off (and as eager
steps). A kernel that read an activation before its wait would read stale values somewhere in the stretch (the
next kernel starts while the one before it still runs)."""

from __future__ import annotations

import pytest
import torch
from kernel_counting import smollm2

from executor_service.engine.kv_cache import KVCache
from executor_service.models.attention_step import build_attention_step
from executor_service.models.loader import build_synthetic
from kernels import pdl
from kernels.small_gemm_table import POLICY_ENV

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
CONTEXT, STEPS, BLOCK_SIZE = 40, 23, 16


def decode(use_pdl: bool, graphed: bool, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The logits [STEPS, vocab] of STEPS decode steps of random tokens after a random CONTEXT-token prompt."""
    monkeypatch.setenv(pdl.ENV, "1" if use_pdl else "0")
    assert pdl.enabled(CUDA) == use_pdl
    cfg = smollm2(4)
    model = build_synthetic(cfg, 0, torch.bfloat16, CUDA).model
    seq_max = CONTEXT + STEPS
    cache = KVCache(cfg, seq_max // BLOCK_SIZE + 2, BLOCK_SIZE, torch.bfloat16, CUDA)
    blocks = [list(range(seq_max // BLOCK_SIZE + 1))]
    torch.manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (CONTEXT,), device=CUDA)
    inputs = torch.randint(0, cfg.vocab_size, (STEPS,)).tolist()
    with torch.inference_mode():
        prefill = build_attention_step("TRITON_ATTN", blocks, [CONTEXT], [CONTEXT], list(range(CONTEXT)), True, CUDA)
        model(prompt, torch.arange(CONTEXT, device=CUDA), cache.layers, prefill)
        ids = torch.zeros(1, dtype=torch.long, device=CUDA)
        pos = torch.tensor([seq_max - 1], device=CUDA)
        # The graph's attention metadata is sized for the longest context; each step writes its length in place.
        step = build_attention_step("TRITON_ATTN", blocks, [1], [seq_max], [seq_max - 1], True, CUDA)
        logits = torch.empty(1, cfg.vocab_size, device=CUDA)

        def forward() -> None:
            logits.copy_(model.compute_logits(model(ids, pos, cache.layers, step)[0]).float())

        graph = None
        if graphed:
            forward()  # compiles; writes the last slot, which the last step below writes again first
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                forward()
        rows = []
        for n, token in enumerate(inputs):
            ids.fill_(token)
            pos.fill_(CONTEXT + n)
            step.seq_lens.fill_(CONTEXT + n + 1)
            step.slot_mapping.fill_(CONTEXT + n)
            graph.replay() if graph is not None else forward()
            rows.append(logits.clone())
        torch.cuda.synchronize()
    return torch.cat(rows)


def test_pdl_graph_decodes_as_eager_without_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    if not pdl.enabled(CUDA):
        pytest.skip("PDL needs sm_90 and a Triton with the griddepcontrol intrinsics")
    monkeypatch.setenv(POLICY_ENV, "triton")
    reference = decode(False, graphed=True, monkeypatch=monkeypatch)
    assert not torch.equal(reference[0], reference[-1])  # each step's input differs
    for graphed in (True, False):
        assert torch.equal(decode(True, graphed=graphed, monkeypatch=monkeypatch), reference), graphed
