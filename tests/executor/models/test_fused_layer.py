"""The decoder model on its fused path (kernels/small_gemm.py and kernels/qkv_rope_gemm.py, under the Triton
interpreter on the CPU, SPECDEC_SMALL_GEMM=triton) and on its unfused one (the plain ops), both against the
same weights in float64 (the dense, unpaged reference of the greedy tests): a prefill of a few rows and a
decode step, Llama and Qwen3 (q/k norm, bias), fp32 and bf16."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from greedy_reference import dense_logits

from executor_service.engine.kv_cache import KVCache
from executor_service.models.attention_step import build_attention_step
from executor_service.models.config import ModelConfig
from executor_service.models.loader import build_synthetic
from executor_service.models.model import DecoderModel
from kernels import qkv_rope_gemm, small_gemm
from kernels.small_gemm_table import POLICY_ENV

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKEND = "TRITON_ATTN" if DEVICE.type == "cuda" else "CPU_ATTN"
PROMPT = [5, 17, 250, 3, 99]


def config(architecture: str) -> ModelConfig:
    """Head size 32: the smallest TRITON_ATTN takes on a GPU."""
    return ModelConfig(
        architecture=architecture, vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=2, num_kv_heads=1, head_size=32, max_position_embeddings=64, rope_theta=10000.0,
        attention_bias=architecture == "qwen3",
    )  # fmt: skip


def run(model: DecoderModel, cfg: ModelConfig, dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits of the prompt's rows, then of one decode step (token 42 at the next position)."""
    cache = KVCache(cfg, 4, 16, dtype, DEVICE)
    logits = []
    for ids, start in ((PROMPT, 0), ([42], len(PROMPT))):
        positions = list(range(start, start + len(ids)))
        step = build_attention_step(BACKEND, [[0]], [len(ids)], [positions[-1] + 1], positions, True, DEVICE)
        input_ids = torch.tensor(ids, device=DEVICE)
        hidden, _ = model(input_ids, torch.tensor(positions, device=DEVICE), cache.layers, step)
        logits.append(model.compute_logits(hidden).double().cpu())
    return logits


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_unfused_layers_match_float64(
    architecture: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(architecture)
    model = build_synthetic(cfg, 7, dtype, DEVICE).model
    dense = build_synthetic(cfg, 7, dtype, DEVICE).model.double()  # the same weights, in float64, unpaged
    reference = [dense_logits(dense, ids).double().cpu() for ids in (PROMPT, [*PROMPT, 42])]
    reference[1] = reference[1][-1:]
    monkeypatch.setenv(POLICY_ENV, "off")
    unfused = run(model, cfg, dtype)
    monkeypatch.setenv(POLICY_ENV, "triton")
    with (
        mock.patch.object(small_gemm, "small_gemm", wraps=small_gemm.small_gemm) as gemms,
        mock.patch.object(qkv_rope_gemm, "qkv_rope_store", wraps=qkv_rope_gemm.qkv_rope_store) as qkv,
    ):
        fused = run(model, cfg, dtype)
    # Per layer and pass: the QKV kernel, o_proj, gate/up + SiLU, down_proj.
    assert (qkv.call_count, gemms.call_count) == (2 * cfg.num_layers, 6 * cfg.num_layers)
    tol = 1e-4 if dtype == torch.float32 else 0.15  # bf16: logits of O(1), ulps of 2^-8 through two layers
    for got_unfused, got_fused, expected in zip(unfused, fused, reference, strict=True):
        torch.testing.assert_close(got_unfused, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(got_fused, expected, rtol=tol, atol=tol)
        assert (got_fused.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
