"""After load, no step compiles a Triton kernel (runner/eager_warm_up.py, the sampler graphs captured at load): eager
forwards of random batches, row counts and contexts, and an engine whose k is scripted through held drafter context
and its flushes, with greedy, seeded sampled, penalised and logprob requests of many prompt lengths. On a GPU (the
CPU compiles nothing)."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
import triton
import triton.language as tl
from engine_driving import Collector, run_bounded
from spec_builders import Scripted, spec_session

from executor_service.engine.one_time_work import TRITON_COMPILES, watch_triton_compiles
from executor_service.runner.eager_warm_up import WarmUpShape, context_pass_forwards, dummy_step, target_forward
from executor_service.sample.sampling import SamplingSettings
from specdec.v1 import common_pb2

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

K = 3
_PROBE_VALUES = itertools.count(1)


@triton.jit
def _probe(out_ptr, VALUE: tl.constexpr) -> None:
    tl.store(out_ptr, VALUE)


def assert_the_hook_counts() -> None:
    """The compile hook sees a kernel compiled now: one specialised on a value it never had in this process (the
    load's own compiles may be none when an earlier test compiled the same kernels)."""
    before = TRITON_COMPILES.total()
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    _probe[(1,)](out, VALUE=next(_PROBE_VALUES))
    assert TRITON_COMPILES.total() == before + 1 and out.item() > 0


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_nothing_compiles_after_load(method: str) -> None:
    watch_triton_compiles()
    session = spec_session(
        method, K, "TRITON_ATTN", device="cuda", dtype=common_pb2.DTYPE_BFLOAT16, max_num_batched_tokens=256
    )
    engine, proposer = session.engine, session.proposer
    assert proposer is not None and engine.deferred is not None
    assert_the_hook_counts()
    at_load = Counter(TRITON_COMPILES)

    device, runner, rng = engine.runner.device, engine.runner, random.Random(3)
    max_model_len = session.limits.max_model_len
    for forward, block_size in [(target_forward(runner), runner.block_size)] + [
        (f, proposer.kv_cache.block_size) for f in context_pass_forwards(proposer, device)
    ]:
        for _ in range(12):
            query_len = rng.choice([1, rng.randint(2, 20), rng.randint(20, 150)])
            shape = WarmUpShape(rng.randint(1, 16), query_len, rng.randint(0, max_model_len // 2))
            positions = torch.arange(shape.context, shape.context + query_len, device=device).repeat(shape.num_requests)
            with torch.inference_mode():
                forward(dummy_step(engine.runner.backend, shape, block_size, device), positions, shape.num_requests)

    engine.speculation = Scripted([0] * 6 + [K] * 2 + [0] * 19 + [K], [0, K])  # short and bounded flushes
    sink = Collector()
    for index in range(12):
        prompt = [(7 * index + 3 * i) % 90 + 1 for i in range(3 + 6 * index)]
        kind = index % 4  # greedy, sampled, penalised, logprobs (the sampler's every graph key)
        temperature, seed = (0.8, index) if kind == 1 else (0.0, None)
        settings = SamplingSettings(
            temperature=temperature, seed=seed, top_p=0.9, ignore_eos=True,
            repetition_penalty=1.2 if kind == 2 else 1.0, logprobs=3 if kind == 3 else None,
        )  # fmt: skip
        engine.add(session.new_request(f"r{index}", prompt, settings, 40, sink))
    run_bounded(engine)
    assert engine.deferred.counts["flushes to draft"] > 0 and engine.deferred.counts["deferred steps"] > 0
    assert all(len(sink.tokens(f"r{i}")) == 40 for i in range(12))
    after = Counter(TRITON_COMPILES)
    after.subtract(at_load)
    assert not +after, f"compiled after load: {dict(+after)}"
