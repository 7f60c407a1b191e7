"""The kernel-count guard of issue 34 for the drafters: SmolLM2-shaped EAGLE-1, EAGLE-3 and DFlash drafters on the
fused path launch at most 6 kernels per decoder layer (attention counted as its two split-KV kernels) on their
chain step (one row per request), their context pass (k + 1 rows) and DFlash's block pass, plus a few per step;
DFlash's context K/V is one kernel per layer.

Kernels are counted with torch.profiler over one eager pass; per layer as the difference between a 4-layer and a
2-layer drafter of the same shape (EAGLE-1, DFlash), or over EAGLE-3's one midlayer called on its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kernel_counting import CONTEXT, MAX_KERNELS_PER_LAYER, kernels_in, smollm2

from executor_service.engine.kv_cache import KVCache
from executor_service.models.attention_step import AttentionStep, build_attention_step
from executor_service.models.draft_config import DraftConfig
from executor_service.models.draft_models import Drafter, TargetHeads
from executor_service.models.draft_weights import synthetic_drafter
from executor_service.models.loader import build_synthetic
from kernels.small_gemm_table import POLICY_ENV

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
MAX_KERNELS_PER_STEP = 12  # embedding, fc, rotary lookup, final add (+ norm), LM head, argmax (2), d2t, ...
BLOCK_SIZE = 16
DFLASH_BLOCK = 16


def drafter_of(method: str, num_layers: int) -> Drafter:
    model = smollm2(num_layers)
    if method == "eagle":
        config = DraftConfig("eagle", model, 7, fc_bias=True)
    elif method == "eagle3":
        config = DraftConfig("eagle3", model, 7, target_layer_ids=(1, 14, 26), draft_vocab_size=32000)
    else:
        config = DraftConfig(
            "dflash", model, DFLASH_BLOCK - 1, target_layer_ids=(1, 9, 17, 25), block_size=DFLASH_BLOCK,
            mask_token_id=49151,
        )  # fmt: skip
    target = build_synthetic(smollm2(2), 0, torch.bfloat16, CUDA).model
    return synthetic_drafter(config, TargetHeads(target.embed_tokens, target.lm_head), 0, torch.bfloat16, CUDA)


def step_of(query_len: int, causal: bool = True) -> tuple[AttentionStep, torch.Tensor, list[int]]:
    seq_len = CONTEXT + query_len
    positions = list(range(CONTEXT, seq_len))
    blocks = list(range(-(-seq_len // BLOCK_SIZE)))
    step = build_attention_step("TRITON_ATTN", [blocks], [query_len], [seq_len], positions, causal, CUDA)
    return step, torch.tensor(positions, device=CUDA), blocks


def eagle_pass(drafter: Drafter, query_len: int) -> Callable[[], object]:
    """A chain step (query_len 1) or a context pass (k + 1 rows): the drafter's forward and its drafts."""
    step, positions, blocks = step_of(query_len)
    cache = KVCache(drafter.config.model, len(blocks) + 1, BLOCK_SIZE, torch.bfloat16, CUDA)
    ids = torch.randint(0, 49152, (query_len,), device=CUDA)
    hidden = torch.randn(query_len, 576, dtype=torch.bfloat16, device=CUDA)

    def run() -> None:
        _, head = drafter(ids, positions, hidden, cache.layers, step)
        drafter.draft_tokens(head)

    return run


def dflash_passes(drafter: Drafter) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the context K/V of k + 1 verified rows, the block pass and its drafts)."""
    step, positions, blocks = step_of(DFLASH_BLOCK, causal=False)
    cache = KVCache(drafter.config.model, len(blocks) + 1, BLOCK_SIZE, torch.bfloat16, CUDA)
    features = torch.randn(8, 4 * 576, dtype=torch.bfloat16, device=CUDA)
    context_positions = torch.arange(CONTEXT - 8, CONTEXT, device=CUDA)
    ids = torch.randint(0, 49152, (DFLASH_BLOCK,), device=CUDA)

    def context() -> None:
        drafter.store_context(features, context_positions, context_positions, cache.layers)

    def block() -> None:
        drafter.draft_tokens(drafter(ids, positions, cache.layers, step))

    return context, block


@pytest.mark.parametrize("query_len", [1, 8])  # chain step; context pass after a verify of 7 drafts
def test_fused_eagle_drafter_launches_at_most_six_kernels_per_layer(
    query_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POLICY_ENV, "triton")
    two, four = (kernels_in(eagle_pass(drafter_of("eagle", n), query_len)) for n in (2, 4))
    per_layer = (four - two) / 2
    assert per_layer <= MAX_KERNELS_PER_LAYER, (two, four)
    assert two - 2 * per_layer <= MAX_KERNELS_PER_STEP, (two, four)


@pytest.mark.parametrize("query_len", [1, 8])
def test_fused_eagle3_midlayer_launches_at_most_six_kernels(query_len: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, "triton")
    drafter = drafter_of("eagle3", 1)
    step, positions, blocks = step_of(query_len)
    cache = KVCache(drafter.config.model, len(blocks) + 1, BLOCK_SIZE, torch.bfloat16, CUDA)
    embeds, hidden = (torch.randn(query_len, 576, dtype=torch.bfloat16, device=CUDA) for _ in range(2))
    rotary = drafter.rope.lookup(positions, torch.bfloat16)
    layer = kernels_in(lambda: drafter.midlayer(embeds, hidden, rotary, cache.layers[0], step))
    assert layer <= MAX_KERNELS_PER_LAYER, layer
    whole = kernels_in(eagle_pass(drafter, query_len))  # the step: + embedding, rotary, norm, head, argmax, d2t
    assert whole - layer <= MAX_KERNELS_PER_STEP, (layer, whole)


def test_fused_dflash_drafter_launches_at_most_six_kernels_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(POLICY_ENV, "triton")
    (context2, block2), (context4, block4) = (dflash_passes(drafter_of("dflash", n)) for n in (2, 4))
    two, four = kernels_in(block2), kernels_in(block4)
    per_layer = (four - two) / 2
    assert per_layer <= MAX_KERNELS_PER_LAYER, (two, four)
    assert two - 2 * per_layer <= MAX_KERNELS_PER_STEP, (two, four)
    context_two, context_four = kernels_in(context2), kernels_in(context4)
    assert (context_four - context_two) / 2 <= 1, (context_two, context_four)  # one K/V kernel per layer


def test_unfused_eagle3_midlayer_launches_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with the fused GEMMs off the midlayer is above the bar (the two norms written side by
    side, GEMM, RoPE + store, attention x 2, o_proj, add-norm, gate/up, SiLU, down = 10)."""
    monkeypatch.setenv(POLICY_ENV, "off")
    drafter = drafter_of("eagle3", 1)
    step, positions, blocks = step_of(1)
    cache = KVCache(drafter.config.model, len(blocks) + 1, BLOCK_SIZE, torch.bfloat16, CUDA)
    embeds, hidden = (torch.randn(1, 576, dtype=torch.bfloat16, device=CUDA) for _ in range(2))
    rotary = drafter.rope.lookup(positions, torch.bfloat16)
    layer = kernels_in(lambda: drafter.midlayer(embeds, hidden, rotary, cache.layers[0], step))
    assert layer > MAX_KERNELS_PER_LAYER, layer
