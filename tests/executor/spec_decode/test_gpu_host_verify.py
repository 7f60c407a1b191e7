"""The host path's verification on CUDA (test_host_verify's cases): every request of the mixed batch keeps its
target distribution, drafts drawn from q too, a seeded request gives the same tokens alone and in the batch, and
verify_on_host waits for the device only in its one host copy (sync debug mode "error" turns any other
synchronization, such as an .item() or a blocking copy, into an error)."""

from __future__ import annotations

import host_verify_runs as runs
import pytest
import torch

import executor_service.spec_decode.host_verify as host_verify
from executor_service.sample.sampling import to_host

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")


def test_a_mixed_batch_keeps_every_target_distribution_on_cuda() -> None:
    distances, _, _ = runs.mixed_distances(CUDA)
    assert max(distances) < runs.BOUND, distances


def test_drafts_drawn_from_q_in_one_batch_on_cuda() -> None:
    distances = runs.drafter_distances(CUDA)
    assert max(distances) < runs.BOUND, distances


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_the_batch_on_cuda() -> None:
    for first, second in runs.alone_and_together(CUDA):
        assert first == second


def test_verify_on_host_waits_for_the_device_only_in_its_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = runs.mixed_batch(CUDA)
    runs.run_batch(batch, 2)  # first calls: pinned buffers, kernels loaded
    calls: list[int] = []
    monkeypatch.setattr(host_verify, "to_host", runs.counting(calls, to_host))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runs.run_batch(batch, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == 3, calls
