"""Penalties, min-p and logprobs on CUDA (bf16, Triton kernels, CUDA graphs): greedy EAGLE-3 and DFlash with
penalties equal the target-only run of the same backend, in a batch with plain greedy requests and one asking
for logprobs (the batch runs on the device-resident step's extras variant: test_gpu_device_penalties.py);
sampled requests with penalties and min-p finish without errors."""

from __future__ import annotations

import random

import pytest
import torch
from executor_builders import tiny_session
from spec_builders import spec_session

from executor_service.engine.request import RequestOutput
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession
from kernels import unavailable_reason
from specdec.v1 import common_pb2

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BF16 = common_pb2.DTYPE_BFLOAT16
MAX_TOKENS = 20
PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 0.5}
SETTINGS = [
    SamplingSettings(**PENALTIES),  # type: ignore[arg-type]
    SamplingSettings(),
    SamplingSettings(logprobs=5),
    SamplingSettings(logprobs=0, **PENALTIES),  # type: ignore[arg-type]
]


def batch(count: int, seed: int) -> dict[str, tuple[list[int], SamplingSettings]]:
    rng = random.Random(seed)
    return {f"r{i}": ([rng.randrange(24) for _ in range(rng.randint(4, 40))], SETTINGS[i % 4]) for i in range(count)}


def run(
    session: ModelSession, requests: dict[str, tuple[list[int], SamplingSettings]]
) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, settings) in requests.items():
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, outputs[rid].append))
    session.engine.run_until_idle()
    assert session.kv_cache.allocator.num_used == 0
    for outs in outputs.values():
        assert all(o.error is None for o in outs), [o.error for o in outs]
    return outputs


def tokens(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_bf16_penalised_speculative_equals_target_only(method: str) -> None:
    reason = unavailable_reason("TRITON_ATTN", torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"TRITON_ATTN: {reason}")
    requests = batch(12, seed=1)
    target = tiny_session(backend="TRITON_ATTN", device="cuda", num_kv_blocks=256, max_num_seqs=16, dtype=BF16)
    expected = tokens(run(target, requests))
    session = spec_session(method, 3, "TRITON_ATTN", device="cuda", dtype=BF16, num_kv_blocks=256,
                           max_num_batched_tokens=256)  # fmt: skip
    outputs = run(session, requests)
    assert tokens(outputs) == expected
    for rid, (_, settings) in requests.items():
        if settings.logprobs is None:
            assert all(o.logprobs is None for o in outputs[rid])
            continue
        for output in outputs[rid]:
            assert output.logprobs is not None and len(output.logprobs) == len(output.token_ids)
            for token_id, found in zip(output.token_ids, output.logprobs, strict=True):
                assert found.token_id == token_id and found.logprob <= 0.0 and len(found.top) == settings.logprobs
                assert all(a[1] >= b[1] for a, b in zip(found.top, found.top[1:], strict=False))


def test_sampled_penalties_and_min_p_finish() -> None:
    session = spec_session("eagle3", 3, "TRITON_ATTN", device="cuda", dtype=BF16, num_kv_blocks=256,
                           max_num_batched_tokens=256)  # fmt: skip
    sampled = SamplingSettings(temperature=0.8, min_p=0.05, seed=7, logprobs=2, **PENALTIES)  # type: ignore[arg-type]
    requests = {rid: (prompt, sampled) for rid, (prompt, _) in batch(8, seed=2).items()}
    first, again = tokens(run(session, requests)), tokens(run(session, requests))
    assert first == again and all(first.values())  # seeded: replayed exactly
