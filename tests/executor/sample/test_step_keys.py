"""The random numbers' keys computed on the host (the host path's) equal those computed on the device (the device
step's), bit for bit, so a seeded request draws the same numbers on either path."""

from __future__ import annotations

import pytest
import torch

from executor_service.sample.device_sampling import (
    DRAFT_STREAM,
    NOISE_STREAM,
    UNIFORM_STREAM,
    SamplingTensors,
    StepKeys,
    seed_value,
    step_keys,
)
from executor_service.sample.sampling import SamplingSettings

CPU = torch.device("cpu")
SEEDS = [0, 1, 7, 2**31 - 1, 2**32 - 1, 2**32, 2**40 + 12345, 2**63 - 1, -1, -(2**63), 2**64 + 5]
POSITIONS = [0, 1, 2, 255, 4095, 2**20 + 3, 2**31 - 1, 2**32 + 9]


def test_host_keys_equal_device_keys_for_every_seed_position_and_stream() -> None:
    pairs = [(s, p) for s in SEEDS for p in POSITIONS]
    seeds = SamplingTensors.build([SamplingSettings(1.0)] * len(pairs), [s for s, _ in pairs], CPU).seed
    positions = torch.tensor([p for _, p in pairs])
    for stream in (UNIFORM_STREAM, NOISE_STREAM, DRAFT_STREAM):
        expected = step_keys(seeds, positions, stream).tolist()
        assert [step_keys(seed_value(s), p, stream) for s, p in pairs] == expected


@pytest.mark.parametrize("depth", [0, 3])
def test_step_keys_on_the_host_equal_those_on_the_device(depth: int) -> None:
    seeds, roots = SEEDS[:6], POSITIONS[:6]
    seed = SamplingTensors.build([SamplingSettings(1.0)] * 6, seeds, CPU).seed
    on_device = StepKeys.on_device(seed, torch.tensor(roots), depth, q_drafts=True)
    on_host = StepKeys.on_host(seeds, roots, CPU, depth, q_drafts=True)
    assert on_host.uniform is not None and on_device.uniform is not None
    assert torch.equal(on_host.uniform, on_device.uniform) and torch.equal(on_host.noise, on_device.noise)
    assert not torch.equal(on_host.uniform, on_host.noise[:, 0])  # the streams differ
    assert StepKeys.on_host(seeds, roots, CPU, depth).uniform is None  # only drafts drawn from q read them


def test_a_row_at_depth_j_has_the_key_of_a_decode_step_at_root_plus_j() -> None:
    """The token after a verify row at depth j is drawn with the key target-only decoding draws it with (its root
    j positions later): the same numbers, so the same token."""
    seeds, roots = SEEDS[:6], POSITIONS[:6]
    deep = StepKeys.on_host(seeds, roots, CPU, 4)
    for j in range(5):
        later = StepKeys.on_host(seeds, [r + j for r in roots], CPU)
        assert torch.equal(deep.noise[:, j], later.noise[:, 0])
