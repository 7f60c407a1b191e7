"""The engine on CUDA with each GPU backend (TRITON_ATTN, FLEX_ATTENTION, FLASH_ATTN): the CPU tests'
guarantee, continuous batching equal to full recompute, on the device.

fp32 (TRITON, FLEX): greedy tokens equal the dense reference exactly. bf16 (all three; FA4 has no fp32):
rounding may flip a near tie, so each generated token is checked teacher-forced against fp32 dense logits
of the same sequence: it must be the reference's argmax up to bf16 noise (within MARGIN of the top logit),
and at least most tokens must be the exact argmax.
"""

from __future__ import annotations

import random

import pytest
import torch
from executor_builders import gpu_test_config
from greedy_reference import dense_logits, greedy_reference

from executor_service.engine.engine import Engine
from executor_service.engine.kv_cache import KVCache
from executor_service.engine.request import RequestOutput
from executor_service.engine.scheduler import Scheduler
from executor_service.models.loader import build_synthetic
from executor_service.runner.model_runner import ModelRunner
from executor_service.sample.sampling import SamplingSettings
from kernels import unavailable_reason

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")
CONFIG = gpu_test_config()
MARGIN = 0.25


def run_engine(backend: str, dtype: torch.dtype, batch: dict[str, list[int]], max_tokens: int, seed: int = 0):
    reason = unavailable_reason(backend, CUDA)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    loaded = build_synthetic(CONFIG, seed, dtype, CUDA)
    cache = KVCache(CONFIG, 256, 16, dtype, CUDA)
    engine = Engine(ModelRunner(loaded.model, cache, backend, CUDA), Scheduler(cache.allocator, 16, 96, 16), 2048)
    outputs: dict[str, list[int]] = {rid: [] for rid in batch}

    def sink(output: RequestOutput) -> None:
        assert output.error is None, output.error
        outputs[output.request_id] += output.token_ids

    from executor_service.engine.request import Request

    for rid, prompt in batch.items():
        engine.add(Request(rid, prompt, SamplingSettings(), max_tokens, frozenset(), sink))
    engine.run_until_idle()
    assert cache.allocator.num_free == cache.num_blocks
    return loaded, outputs


def batch_of(count: int, seed: int, longest: int = 200) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randint(1, longest))] for i in range(count)}


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLEX_ATTENTION"])
def test_fp32_greedy_equals_full_recompute(backend: str) -> None:
    batch = batch_of(8, seed=1)
    loaded, outputs = run_engine(backend, torch.float32, batch, 16)
    for rid, prompt in batch.items():
        assert outputs[rid] == greedy_reference(loaded.model, prompt, 16), (backend, rid)


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLEX_ATTENTION", "FLASH_ATTN"])
def test_bf16_tokens_are_the_reference_argmax_up_to_rounding(backend: str) -> None:
    batch = batch_of(8, seed=2)
    loaded, outputs = run_engine(backend, torch.bfloat16, batch, 16)
    reference = build_synthetic(CONFIG, 0, torch.float32, CUDA).model
    # The same weights: the fp32 model drawn from the same seed, rounded like the bf16 one.
    for name, parameter in reference.named_parameters():
        parameter.data.copy_(loaded.model.get_parameter(name).float())
    exact = total = 0
    for rid, prompt in batch.items():
        logits = dense_logits(reference, prompt + outputs[rid])[len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(outputs[rid], device=CUDA)[:, None])[:, 0]
        gaps = logits.max(dim=1).values - chosen
        assert gaps.max().item() <= MARGIN, (backend, rid, gaps.tolist())
        exact += int((gaps == 0).sum())
        total += len(outputs[rid])
    assert exact >= 0.9 * total, (backend, exact, total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_matches_the_torch_expression(dtype: torch.dtype) -> None:
    from executor_service.models.rope import RotaryEmbedding, _rotate, apply_rotary

    rope = RotaryEmbedding(CONFIG).to(CUDA)
    qkv = torch.randn(37, (8 + 2 + 2) * 64, device=CUDA, dtype=dtype)
    q, k, _ = qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(37, 8, 64), k.view(37, 2, 64)
    cos, sin = rope.lookup(torch.arange(100, 137, device=CUDA), dtype)
    expected_q, expected_k = _rotate(q.float(), cos.float(), sin.float()), _rotate(k.float(), cos.float(), sin.float())
    got_q, got_k = apply_rotary(q, k, cos, sin)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q.float(), expected_q, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_k.float(), expected_k, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASH_ATTN"])
def test_decode_graphs_give_the_eager_tokens(backend: str) -> None:
    """The same batch through the session's CUDA-graph decode and through eager steps: same tokens."""
    from executor_builders import tiny_session

    from executor_service.sample.sampling import SamplingSettings as Settings
    from specdec.v1 import common_pb2

    reason = unavailable_reason(backend, CUDA)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    tokens = {}
    for graphs in (True, False):
        session = tiny_session(
            backend=backend, device="cuda", num_kv_blocks=128, cuda_graphs=graphs, dtype=common_pb2.DTYPE_BFLOAT16
        )
        assert bool(session.engine.runner.graphs) == graphs
        outputs: dict[str, list[int]] = {}

        def sink(output: RequestOutput, outputs: dict[str, list[int]] = outputs) -> None:
            outputs.setdefault(output.request_id, []).extend(output.token_ids)

        for rid, prompt in batch_of(5, seed=3, longest=60).items():
            prompt = [t % session.limits.vocab_size for t in prompt]  # the tiny model's vocabulary
            session.engine.add(session.new_request(rid, prompt, Settings(), 20, sink))
        session.engine.run_until_idle()
        tokens[graphs] = outputs
    assert tokens[True] == tokens[False]
