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


@pytest.mark.parametrize("choice", ["", "auto", "NCCL", "one-shot", "Unfused", "push", "Signal"])
def test_known_choices(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    monkeypatch.setenv(all_reduce_module.ENV, choice)
    assert all_reduce_module.choice() == (choice.lower() or "auto")


def test_auto_pushes_rows_where_measured() -> None:
    """`auto` pushes the fused all-reduce's rows (measured faster at 2 and 4 ranks), as `push` does; `signal`
    signals its peers, and the unfused choices have no fused kernel to push with."""
    pushes = all_reduce_module.pushes_rows
    assert pushes("auto") and pushes("push")
    assert not pushes("signal") and not pushes("unfused") and not pushes("nccl") and not pushes("one-shot")


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


def test_sizes_route_by_the_measured_limits() -> None:
    """At 2 ranks one-shot up to 1 MiB, two-shot up to 8 MiB (whole 16-byte vectors), NCCL above; at 4 one-shot
    only up to 512 KiB; with two-shot off (the `one-shot` choice) nothing past the one-shot limit."""
    limits = all_reduce_module.size_limits(2, two_shot=True)
    assert limits == (1 << 20, 8 << 20)
    route = all_reduce_module.route
    assert [route(n, *limits) for n in (0, 16, 8192, 1 << 20)] == ["nccl", "one-shot", "one-shot", "one-shot"]
    assert [route(n, *limits) for n in ((1 << 20) + 16, 2 << 20, 8 << 20)] == ["two-shot"] * 3
    assert route((1 << 20) + 2, *limits) == "nccl"  # not whole vectors: two-shot cannot split it
    assert route((8 << 20) + 16, *limits) == "nccl"
    four = all_reduce_module.size_limits(4, two_shot=True)
    assert four == (512 << 10, 8 << 20) and route(1 << 20, *four) == "two-shot"
    alone = all_reduce_module.size_limits(2, two_shot=False)
    assert alone == (1 << 20, 1 << 20) and route((1 << 20) + 16, *alone) == "nccl"
