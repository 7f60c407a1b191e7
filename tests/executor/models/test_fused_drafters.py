"""The drafters (EAGLE-1, EAGLE-3's midlayer, DFlash) on the fused path (kernels/small_gemm.py and
kernels/qkv_rope_gemm.py under the Triton interpreter on the CPU, SPECDEC_SMALL_GEMM=triton) and on the unfused
one (the plain ops), both against the same weights in float64 run through the drafters' dense training passes
(specdec_training/unroll.py: no cache, no paging): EAGLE's context pass over a few rows then one chain
step, DFlash's context K/V then its block pass; fp32 and bf16."""

from __future__ import annotations

import copy
import os
from unittest import mock

import pytest
import torch

from executor_service.engine.kv_cache import KVCache
from executor_service.models import fused_ops
from executor_service.models.attention_step import build_attention_step
from executor_service.models.config import ModelConfig
from executor_service.models.draft_config import DraftConfig
from executor_service.models.draft_models import DFlashDrafter, Drafter, TargetHeads
from executor_service.models.draft_weights import synthetic_drafter
from executor_service.models.loader import build_synthetic
from kernels import qkv_rope_gemm, small_gemm
from kernels.small_gemm_table import POLICY_ENV
from specdec_training.unroll import dflash_blocks, eagle_unroll

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKEND = "TRITON_ATTN" if DEVICE.type == "cuda" else "CPU_ATTN"
IDS = [5, 17, 250, 3, 99, 42]  # EAGLE: rows 0..4 of the context pass; DFlash: context 0..4, the block at 5
ROWS = 5
CHAIN_ROW = 2  # the chain step drafts after row 2 was verified: position 3, token 4
BLOCK = 4


def model_config(architecture: str, num_layers: int) -> ModelConfig:
    return ModelConfig(
        architecture=architecture, vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_size=16, max_position_embeddings=64, rope_theta=10000.0,
        attention_bias=architecture == "qwen3",
    )  # fmt: skip


def draft_config(method: str, architecture: str) -> DraftConfig:
    if method == "eagle":
        return DraftConfig("eagle", model_config(architecture, 2), 3, fc_bias=True)
    if method == "eagle3":
        return DraftConfig("eagle3", model_config(architecture, 1), 3, target_layer_ids=(0, 1, 2), draft_vocab_size=96)
    return DraftConfig(
        "dflash", model_config(architecture, 2), BLOCK - 1, target_layer_ids=(0, 1), block_size=BLOCK,
        mask_token_id=255,
    )  # fmt: skip


def build(method: str, architecture: str, dtype: torch.dtype) -> tuple[Drafter, Drafter]:
    """The drafter in `dtype` and the same weights in float64 (its target's heads too)."""
    config = draft_config(method, architecture)
    target = build_synthetic(model_config(architecture, 2), 3, dtype, DEVICE).model
    drafter = synthetic_drafter(config, TargetHeads(target.embed_tokens, target.lm_head), 11, dtype, DEVICE)
    target64 = copy.deepcopy(target).double()
    drafter.target = None  # not copied with the drafter
    drafter64 = copy.deepcopy(drafter).double()
    drafter.target = TargetHeads(target.embed_tokens, target.lm_head)
    drafter64.target = TargetHeads(target64.embed_tokens, target64.lm_head)
    return drafter, drafter64


def features(config: DraftConfig, dtype: torch.dtype) -> torch.Tensor:
    width = config.model.hidden_size * max(len(config.target_layer_ids), 1)
    generator = torch.Generator().manual_seed(5)
    return torch.randn(len(IDS), width, generator=generator).to(dtype=dtype, device=DEVICE)


def ids_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE)


def run_eagle(drafter: Drafter, feats: torch.Tensor) -> list[torch.Tensor]:
    """(feedback, head) of the context pass's rows, then of one chain step: the engine's paged passes."""
    cache = KVCache(drafter.config.model, 4, 16, feats.dtype, DEVICE)
    positions = list(range(ROWS))
    step = build_attention_step(BACKEND, [[0]], [ROWS], [ROWS], positions, True, DEVICE)
    next_ids = ids_tensor([*IDS[1:ROWS], 0])  # row p reads token p + 1 (the last row: none yet)
    hidden = drafter.combine(feats[:ROWS])
    feedback, head = drafter(next_ids, ids_tensor(positions), hidden, cache.layers, step)
    position = CHAIN_ROW + 1
    chain = build_attention_step(BACKEND, [[0]], [1], [position + 1], [position], True, DEVICE)
    chain_ids = ids_tensor([IDS[CHAIN_ROW + 2]])
    feedback1, head1 = drafter(
        chain_ids, ids_tensor([position]), feedback[CHAIN_ROW : CHAIN_ROW + 1], cache.layers, chain
    )
    return [feedback, head, feedback1, head1]


def dense_eagle(drafter64: Drafter, feats: torch.Tensor) -> list[torch.Tensor]:
    steps = eagle_unroll(drafter64, ids_tensor(IDS[:ROWS])[None], feats[:ROWS].double()[None], 2)
    row = slice(CHAIN_ROW, CHAIN_ROW + 1)
    return [steps[0].feedback[0], steps[0].head[0], steps[1].feedback[0, row], steps[1].head[0, row]]


def run_dflash(drafter: DFlashDrafter, feats: torch.Tensor) -> list[torch.Tensor]:
    """The block pass's normed hidden states after the context's K/V were stored: the engine's paged passes."""
    cache = KVCache(drafter.config.model, 4, 16, feats.dtype, DEVICE)
    positions = list(range(ROWS))
    drafter.store_context(feats[:ROWS], ids_tensor(positions), ids_tensor(positions), cache.layers)
    block_positions = list(range(ROWS, ROWS + BLOCK))
    step = build_attention_step(BACKEND, [[0]], [BLOCK], [ROWS + BLOCK], block_positions, False, DEVICE)
    block_ids = ids_tensor([IDS[ROWS]] + [drafter.config.mask_token_id] * (BLOCK - 1))
    return [drafter(block_ids, ids_tensor(block_positions), cache.layers, step)]


def dense_dflash(drafter64: DFlashDrafter, feats: torch.Tensor) -> list[torch.Tensor]:
    return [dflash_blocks(drafter64, ids_tensor(IDS)[None], feats.double()[None], ids_tensor([[ROWS]]))[0, 0]]


def head_logits(drafter: Drafter, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every output, then the head's logits of the ones it reads, in float64 on the CPU."""
    heads = outputs[1::2] if len(outputs) > 1 else outputs
    return [t.double().cpu() for t in [*outputs, *(drafter.draft_logits(h) for h in heads)]]


# (method, architecture): Qwen3's per-head q/k norm and biases through EAGLE-3's and DFlash's kernels too.
CASES = [("eagle", "llama"), ("eagle3", "llama"), ("eagle3", "qwen3"), ("dflash", "llama"), ("dflash", "qwen3")]


@pytest.mark.parametrize(("method", "architecture"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_and_unfused_drafters_match_float64(
    method: str, architecture: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    drafter, drafter64 = build(method, architecture, dtype)
    feats = features(drafter.config, dtype)
    run, dense = (run_dflash, dense_dflash) if method == "dflash" else (run_eagle, dense_eagle)
    with torch.no_grad():
        reference = head_logits(drafter64, dense(drafter64, feats))
        monkeypatch.setenv(POLICY_ENV, "off")
        unfused = head_logits(drafter, run(drafter, feats))
        monkeypatch.setenv(POLICY_ENV, "triton")
        with (
            mock.patch.object(small_gemm, "small_gemm", wraps=small_gemm.small_gemm) as gemms,
            mock.patch.object(qkv_rope_gemm, "qkv_rope_store", wraps=qkv_rope_gemm.qkv_rope_store) as qkv,
            mock.patch.object(fused_ops, "concat_rms_norm", wraps=fused_ops.concat_rms_norm) as concat_norm,
            mock.patch("executor_service.models.fused_layer.concat_rms_norm", concat_norm),
        ):
            fused = head_logits(drafter, run(drafter, feats))
    layers = drafter.config.model.num_layers
    passes = 1 if method == "dflash" else 2
    # Per layer and pass: the QKV kernel, o_proj, gate/up + SiLU, down_proj; EAGLE-1's fc per pass; DFlash's fc
    # and its context K/V kernel per layer.
    expected_qkv = passes * layers + (layers if method == "dflash" else 0)
    expected_gemms = passes * 3 * layers + {"eagle": passes, "eagle3": 0, "dflash": 1}[method]
    assert (qkv.call_count, gemms.call_count) == (expected_qkv, expected_gemms)
    assert concat_norm.call_count == 0  # EAGLE-3's two norms are the QKV kernel's prologue
    tol = 1e-4 if dtype == torch.float32 else 0.15  # bf16: values of O(1), ulps of 2^-8 through two layers
    for got_unfused, got_fused, expected in zip(unfused, fused, reference, strict=True):
        torch.testing.assert_close(got_unfused, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(got_fused, expected, rtol=tol, atol=tol)
    for got_fused, expected in zip(fused[-2:], reference[-2:], strict=False):  # the logits: the same drafts
        assert (got_fused.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75
