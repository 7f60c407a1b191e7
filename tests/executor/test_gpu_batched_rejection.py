"""Batched rejection sampling on CUDA (test_batched_rejection's cases with CUDA generators): every request of
the mixed batch keeps its target distribution, sampled drafters too, a seeded request gives the same tokens
alone and in the batch, and verify_batch waits for the device only in its one host copy (sync debug mode
"error" turns any other synchronization, such as an .item() or a blocking copy, into an error)."""

from __future__ import annotations

import pytest
import torch
from batched_rejection_runs import (
    BOUND,
    alone_and_together,
    counting,
    drafter_distances,
    mixed_batch,
    mixed_distances,
    run_batch,
)

import executor_service.rejection_sampler as rejection_sampler
import executor_service.sampling as sampling
from executor_service.sampling import make_generator, to_host

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")


def test_a_mixed_batch_keeps_every_target_distribution_on_cuda() -> None:
    distances, _, _ = mixed_distances(CUDA)
    assert max(distances) < BOUND, distances


def test_sampled_drafters_in_one_batch_on_cuda() -> None:
    distances = drafter_distances(CUDA)
    assert max(distances) < BOUND, distances


@pytest.mark.parametrize("rows_per_pass", [128, 3])
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_the_batch_on_cuda(
    rows_per_pass: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rejection_sampler, "ROWS_PER_PASS", rows_per_pass)
    for alone, together in alone_and_together(CUDA):
        assert alone == together


def test_verify_batch_waits_for_the_device_only_in_its_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = mixed_batch(CUDA)
    generators = [make_generator(s, CUDA) for s in batch.settings]
    run_batch(batch, generators, 2)  # first calls: token counts, pinned buffers, kernels loaded
    calls: list[int] = []
    monkeypatch.setattr(rejection_sampler, "to_host", counting(calls, to_host))
    monkeypatch.setattr(sampling, "to_host", counting(calls, to_host))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_batch(batch, generators, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == 3, calls
