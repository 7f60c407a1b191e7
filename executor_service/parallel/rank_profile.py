"""Where a tensor-parallel step's time goes on each rank: torch.profiler around the steps rank 0 marks.

Rank 0 sends PROFILE on and off (protocol.py) around the steps it wants measured; every follower profiles the
ops between and, at off, writes its summary to $SPECDEC_TP_PROFILE_DIR/rank<r>.json: the steps (its FORWARD and
REPLAY ops), the GPU's kernel time and the wall time per step, the collectives' share of the kernel time, and
the costliest kernels. Rank 0 summarises its own profile the same way (`summarize`), so the ranks compare: a
rank whose wall time per step exceeds its kernel time waits on its host (or on a slower rank, in a collective).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

PROFILE_DIR_ENV = "SPECDEC_TP_PROFILE_DIR"
# Where each rank also writes its kernels' timeline (timeline_rank<r>.json): the ranks' kernels on one host share
# the host's clock, so lining them up shows which rank reaches each collective last (bench/tp_timeline.py).
TIMELINE_DIR_ENV = "SPECDEC_TP_TIMELINE_DIR"
TIMELINE_KERNELS = 4000
TOP_KERNELS = 12

log = logging.getLogger("specdec.parallel")


def is_collective(kernel: str) -> bool:
    """NCCL's kernels and symmetric memory's all-reduce (parallel/all_reduce.py): the time a rank spends in them
    includes its wait for the slowest rank."""
    name = kernel.lower()
    return "nccl" in name or "all_reduce" in name


def summarize(prof: profile, seconds: float, steps: int, cuda: bool) -> dict[str, Any]:
    """Per step: the kernels' time and the wall time (GPU), the collectives' time and share (NCCL's and the
    one-shot all-reduce's kernels on the GPU, gloo's ops on the CPU), and the costliest kernels."""
    events = prof.key_averages()
    steps = max(steps, 1)
    if cuda:
        kernels = sorted(((e.key, e.self_device_time_total) for e in events), key=lambda kt: -kt[1])
        total = sum(t for _, t in kernels)
        collective_us = sum(t for key, t in kernels if is_collective(key))
        share = collective_us / total if total else None
    else:
        kernels, total = [], 0.0
        collective_us = sum(e.cpu_time_total for e in events if e.key.startswith("gloo:"))
        share = collective_us / 1e6 / seconds if seconds > 0 else None
    report: dict[str, Any] = {
        "share": round(share, 4) if share is not None else None,
        "per_step_ms": round(collective_us / 1000 / steps, 4),
        "profiled_steps": steps,
        "profiled_seconds": round(seconds, 3),
    }
    if cuda:  # the GPU busy (kernels) against the wall, and the costliest kernels
        report["kernel_ms_per_step"] = round(total / 1000 / steps, 4)
        report["wall_ms_per_step"] = round(seconds * 1000 / steps, 4)
        report["top_kernels_us_per_step"] = {key[:80]: round(t / steps, 1) for key, t in kernels[:TOP_KERNELS]}
    return report


def kernel_timeline(prof: profile) -> list[tuple[str, float, float]]:
    """The profiled GPU kernels in start order, at most TIMELINE_KERNELS: (name, start us, duration us), the starts
    on the host's clock (the profiler's events count from its own trace start, which differs by rank)."""
    results = getattr(prof.profiler, "kineto_results", None)
    origin = results.trace_start_ns() / 1000 if results is not None else 0.0
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [
        (e.name[:60], round(origin + e.time_range.start, 2), round(e.time_range.elapsed_us(), 2))
        for e in kernels[:TIMELINE_KERNELS]
    ]


def write_timeline(prof: profile, rank: int) -> None:
    """timeline_rank<rank>.json under $SPECDEC_TP_TIMELINE_DIR, where it is set (GPU profiles only)."""
    folder = os.environ.get(TIMELINE_DIR_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"timeline_rank{rank}.json").write_text(json.dumps(kernel_timeline(prof)))


class RankProfile:
    """A follower's profile between PROFILE on and off; `count_step` is told of each FORWARD and REPLAY."""

    def __init__(self, rank: int, cuda: bool) -> None:
        self.rank, self.cuda = rank, cuda
        self.prof: profile | None = None
        self.started, self.steps = 0.0, 0

    def toggle(self, on: bool) -> None:
        if on and self.prof is None:
            activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
            self.prof = profile(activities=[activity])
            self.prof.__enter__()
            self.started, self.steps = time.perf_counter(), 0
        elif not on and self.prof is not None:
            if self.cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            summary = summarize(self.prof, seconds, self.steps, self.cuda)
            if self.cuda:
                write_timeline(self.prof, self.rank)
            self.prof = None
            self._write(summary)

    def count_step(self) -> None:
        if self.prof is not None:
            self.steps += 1

    def _write(self, summary: dict[str, Any]) -> None:
        folder = os.environ.get(PROFILE_DIR_ENV)
        if not folder:
            log.info("rank %d profile (no %s set): %s", self.rank, PROFILE_DIR_ENV, summary)
            return
        path = Path(folder) / f"rank{self.rank}.json"
        path.write_text(json.dumps(summary, indent=1))
