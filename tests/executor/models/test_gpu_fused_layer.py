"""The kernel-count guard of issue 34: a SmolLM2-shaped decode (and verify) step on the fused path launches at
most 6 kernels per decoder layer (attention counted as its two split-KV kernels), plus a few per step.

Kernels are counted with torch.profiler over one eager forward; per layer as the difference between a 4-layer
and a 2-layer model of the same shape, so what a step launches once (embedding, rotary lookup, final norm, LM
head) cancels out."""

from __future__ import annotations

import pytest
import torch
from kernel_counting import CONTEXT, MAX_KERNELS_PER_LAYER, kernels_in, smollm2

from executor_service.engine.kv_cache import KVCache
from executor_service.models.attention_step import build_attention_step
from executor_service.models.loader import build_synthetic
from kernels.small_gemm_table import POLICY_ENV

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
MAX_KERNELS_PER_STEP = 12  # embedding, rotary lookup (cos, sin), final add + norm, LM head, fp32 logits, ...


def kernels_in_step(num_layers: int, query_len: int) -> int:
    cfg = smollm2(num_layers)
    model = build_synthetic(cfg, 0, torch.bfloat16, CUDA).model
    block_size = 16
    cache = KVCache(cfg, CONTEXT // block_size + 2, block_size, torch.bfloat16, CUDA)
    seq_len = CONTEXT + query_len
    positions = list(range(CONTEXT, seq_len))
    blocks = list(range(-(-seq_len // block_size)))
    step = build_attention_step("TRITON_ATTN", [blocks], [query_len], [seq_len], positions, True, CUDA)
    ids = torch.randint(0, cfg.vocab_size, (query_len,), device=CUDA)
    pos = torch.tensor(positions, device=CUDA)

    def forward() -> None:
        hidden, _ = model(ids, pos, cache.layers, step)
        model.compute_logits(hidden)

    return kernels_in(forward)


@pytest.mark.parametrize("query_len", [1, 8])  # decode; verify of 7 drafts
def test_fused_smollm2_step_launches_at_most_six_kernels_per_layer(
    query_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POLICY_ENV, "triton")
    two, four = kernels_in_step(2, query_len), kernels_in_step(4, query_len)
    per_layer = (four - two) / 2
    assert per_layer <= MAX_KERNELS_PER_LAYER, (two, four)
    assert two - 2 * per_layer <= MAX_KERNELS_PER_STEP, (two, four)


def test_unfused_path_launches_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the fused GEMMs off the same count is above the bar (add-norm, GEMM, RoPE +
    store, attention x 2, o_proj, add-norm, gate/up, SiLU, down = 10), so the guard measures the fusion."""
    monkeypatch.setenv(POLICY_ENV, "off")
    two, four = kernels_in_step(2, 1), kernels_in_step(4, 1)
    assert (four - two) / 2 > MAX_KERNELS_PER_LAYER, (two, four)
