"""The random numbers' hash as Triton kernels (sample/hash_kernels.py), under the interpreter on the CPU or compiled
on a GPU, against device_sampling's torch expressions: the same keys and uniforms bit for bit, for seeds across the
63 bits a request's seed takes, positions past 2^32 (masked as the torch path masks them), every stream, keys of one
position or of several per seed (a drafter's picks), and uniform rows shorter than, equal to and longer than a
block."""

from __future__ import annotations

import os

import pytest
import torch

from executor_service.sample.device_sampling import (
    DRAFT_STREAM,
    NOISE_STREAM,
    UNIFORM_STREAM,
    StepKeys,
    position_keys,
    step_keys,
    uniforms,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SEEDS = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1, 987654321987])


def test_step_keys_equal_the_torch_expression() -> None:
    from executor_service.sample.hash_kernels import triton_step_keys

    positions = torch.tensor([0, 7, 2**31, 2**32 + 5, 2**40 + 3, 300, 12])
    streams = (UNIFORM_STREAM, NOISE_STREAM, DRAFT_STREAM)
    got = triton_step_keys(SEEDS.to(DEVICE), positions.to(DEVICE), streams).cpu()
    expected = torch.stack([step_keys(SEEDS, positions, stream) for stream in streams])
    assert torch.equal(got, expected)
    assert got.max() < 2**32 and got.min() >= 0


def test_several_positions_per_seed_equal_the_broadcast_expression() -> None:
    from executor_service.sample.hash_kernels import triton_step_keys

    positions = torch.arange(len(SEEDS) * 5).view(len(SEEDS), 5) * 37 + 11
    got = triton_step_keys(SEEDS.to(DEVICE), positions.reshape(-1).to(DEVICE), (DRAFT_STREAM,))[0].cpu()
    assert torch.equal(got, step_keys(SEEDS[:, None], positions, DRAFT_STREAM).reshape(-1))


@pytest.mark.parametrize("count", [1, 15, 1024, 3001])
def test_uniforms_equal_the_torch_expression(count: int) -> None:
    from executor_service.sample.hash_kernels import triton_uniforms

    keys = step_keys(SEEDS, torch.arange(len(SEEDS)), NOISE_STREAM)
    got = triton_uniforms(keys.to(DEVICE), count).cpu()
    assert torch.equal(got, uniforms(keys, count))  # the CPU's uniforms is the torch expression
    assert got.shape == (len(SEEDS), count) and got.min() > 0.0 and got.max() < 1.0
    assert len(set(got[0].tolist())) > 0.99 * count, "distinct numbers along a row"


def test_the_dispatchers_take_the_kernels_on_a_gpu_and_torch_elsewhere() -> None:
    """position_keys and StepKeys.on_device give the torch expression's keys on either path."""
    positions = torch.tensor([3, 9, 2**33, 4, 5, 6, 7])
    (flat,) = position_keys(SEEDS.to(DEVICE), positions.to(DEVICE), (UNIFORM_STREAM,))
    assert torch.equal(flat.cpu(), step_keys(SEEDS, positions, UNIFORM_STREAM))
    keys = StepKeys.on_device(SEEDS.to(DEVICE), positions.to(DEVICE), 2, q_drafts=True)
    assert keys.uniform is not None and torch.equal(keys.uniform.cpu(), flat.cpu())
    deeper = positions[:, None] + torch.arange(3)[None, :]  # a row at depth j: keyed by root + j
    assert torch.equal(keys.noise.cpu(), step_keys(SEEDS[:, None], deeper, NOISE_STREAM))


def test_a_refused_kernel_leaves_the_torch_expressions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch the compiler or driver refuses returns None (the caller then runs the torch ops, the same numbers),
    and so does every later one: the choice is made once, before any graph captures a launch."""
    from executor_service.sample import hash_kernels

    monkeypatch.setattr(hash_kernels, "_refused", [])

    def refused() -> torch.Tensor:
        raise RuntimeError("no such instruction")

    assert hash_kernels.launched(lambda: torch.ones(1)) is not None
    assert hash_kernels.launched(refused) is None
    assert hash_kernels.launched(lambda: torch.ones(1)) is None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="routes CPU tensors through the interpreter")
def test_a_sampled_device_step_on_the_kernels_draws_the_same_in_fewer_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain's sampled device step at batch 1 with the hash on the kernels (the interpreter standing in for a GPU):
    the same tokens as with the torch ops, and the step's own ops fall by the keys' and the uniforms' (2026-11-29,
    the sorted variant: 335 -> 268, some of them the interpreter's copies around its launches; 463 -> 328 before
    the rows' draws decided the hits)."""
    from engine_driving import Collector
    from op_counting import OpCounter, count_each_call
    from spec_builders import spec_session

    from executor_service.sample import device_sampling, hash_kernels
    from executor_service.sample.sampling import SamplingSettings

    monkeypatch.setattr(hash_kernels, "_refused", [])  # a refusal here must not switch the process's kernels off

    runs = []
    for kernels in (False, True):
        monkeypatch.setattr(device_sampling, "hash_kernels_take", lambda tensor, on=kernels: on)
        mode = OpCounter(lambda func: not func.is_view)
        session = spec_session("eagle3", 3, max_num_batched_tokens=64)
        step = session.engine.spec_step
        session.engine.runner.forward = mode.paused(session.engine.runner.forward)
        counts = count_each_call(mode, step)
        sink = Collector()
        settings = SamplingSettings(0.8, top_p=0.95, seed=7)
        session.engine.add(session.new_request("a", [3, 4, 5, 6], settings, 10, sink))
        session.engine.run_until_idle()
        assert step.counts["sorted"] > 0
        runs.append((sink.tokens("a"), max(counts[1:])))
    (torch_tokens, torch_ops), (kernel_tokens, kernel_ops) = runs
    assert kernel_tokens == torch_tokens
    assert kernel_ops <= torch_ops - 50, runs
