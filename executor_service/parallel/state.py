"""Tensor-parallel state of this process: its rank, the groups, and whether a rank has failed.

One process per device. The default group (NCCL on CUDA, gloo on the CPU) carries the model's collectives
and the steps' tensors; a gloo group carries the small host-side control messages, so a follower waiting
for the next step blocks on a socket, not inside an NCCL kernel with a watchdog timeout. As in vLLM, the
state is per process (`get_tp_group`), set once at start.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from executor_service.config import ModelConfig
from specdec_runtime.errors import FieldViolation, SpecdecError

FLAG = "--tensor-parallel-size"
MAX_TENSOR_PARALLEL_SIZE = 64
# A step's collectives finish in seconds; a dead peer on NCCL is noticed at this timeout at the latest.
STEP_TIMEOUT = timedelta(minutes=5)
# Followers wait for rank 0's next op on the control group; an idle rank 0 sends a no-op every KEEPALIVE_S.
CONTROL_TIMEOUT = timedelta(days=1)
KEEPALIVE_S = float(os.environ.get("SPECDEC_TP_KEEPALIVE_S", "600"))


class RankUnavailable(SpecdecError):
    """A tensor-parallel rank is gone: no step can run again until the server is restarted."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    control: dist.ProcessGroup | None = None  # gloo: the control messages (protocol.py)
    lock: threading.Lock = field(default_factory=threading.Lock)  # rank 0: one op on the wire at a time
    failure: str | None = None  # why the group can no longer run steps
    last_op: float = field(default_factory=time.monotonic)  # rank 0: when the last op began (keep-alive)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason[:500]

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RankUnavailable(f"tensor parallelism is broken: {self.failure}; restart the executor")


_group: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> TensorParallelGroup:
    """Join the group (every rank calls it with the same world size and init method)."""
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # N ranks on one CPU: share its cores instead of each taking all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, world_size, device, control)
    return _group


def get_tp_group() -> TensorParallelGroup | None:
    """This process's group; None when it runs alone (tensor-parallel size 1)."""
    return _group


def tensor_parallel_size() -> int:
    return _group.world_size if _group is not None else 1


def check_ranks_alive() -> None:
    """RankUnavailable once a rank has failed (a no-op without tensor parallelism)."""
    if _group is not None:
        _group.check_alive()


def destroy_tensor_parallel() -> None:
    global _group
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group = None


def check_tensor_parallel_size(size: int) -> None:
    """The flag itself, at start: ValueError (the CLI's bad-setup exit) naming it."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(f"{FLAG} must be between 1 and {MAX_TENSOR_PARALLEL_SIZE}, not {size}")


def shard_violations(config: ModelConfig, size: int, field: str) -> list[FieldViolation]:
    """What of the target cannot be split `size` ways: heads, KV heads and the MLP's width must divide."""
    if size == 1:
        return []
    counts = (
        ("attention heads", config.num_heads),
        ("KV heads", config.num_kv_heads),
        ("MLP intermediate size", config.intermediate_size),
    )
    return [
        FieldViolation(field, f"the target's {count} {name} do not divide by {FLAG} {size}: each rank needs whole ones")
        for name, count in counts
        if count % size
    ]
