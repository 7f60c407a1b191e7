"""SPECDEC_TP_ALL_REDUCE is read strictly, and the CPU (gloo) keeps its own all-reduce: the one-shot path is
CUDA's (test_all_reduce_gpu.py runs it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from executor_service.parallel import all_reduce as all_reduce_module


def test_unknown_choice_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(all_reduce_module.ENV, "ring" * 40)
    with pytest.raises(ValueError, match=all_reduce_module.ENV) as info:
        all_reduce_module.choice()
    assert len(str(info.value)) < 200  # the echoed value is cut


@pytest.mark.parametrize("choice", ["", "auto", "NCCL", "one-shot"])
def test_known_choices(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    monkeypatch.setenv(all_reduce_module.ENV, choice)
    assert all_reduce_module.choice() == (choice.lower() or "auto")


def test_cpu_group_sums_through_gloo(tmp_path) -> None:
    """One gloo rank: set up leaves the one-shot path off, and all_reduce sums in place as before."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert all_reduce_module.set_up_all_reduce(torch.device("cpu"), 1) == "gloo"
        x = torch.arange(4.0)
        assert torch.equal(all_reduce_module.all_reduce(x), torch.arange(4.0))
    finally:
        all_reduce_module.forget_all_reduce()
        dist.destroy_process_group()
