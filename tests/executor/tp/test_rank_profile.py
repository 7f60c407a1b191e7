"""What a profiled step counts as collective time: NCCL's kernels and the one-shot all-reduce's (the kernel names
the 4x H200 profile showed), not GEMMs or attention."""

from __future__ import annotations

import pytest

from executor_service.parallel.rank_profile import is_collective


@pytest.mark.parametrize(
    "kernel",
    [
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(c10",
    ],
)
def test_collectives(kernel: str) -> None:
    assert is_collective(kernel)


@pytest.mark.parametrize(
    "kernel", ["nvjet_sm90_tst_128x32_64x10_4x1_v_bz_TNT", "_paged_attention_kernel", "add_rms_norm_kernel"]
)
def test_compute(kernel: str) -> None:
    assert not is_collective(kernel)
