"""Tensor-parallel state of this process: its rank, the groups, and whether a rank has failed.

One process per device. The default group (NCCL on CUDA, gloo on the CPU) carries the model's collectives
and the steps' tensors. Rank 0's op messages go through a shared-memory ring (channel.py): a follower waiting
for the next step polls memory, not a socket or an NCCL kernel with a timeout. A gloo group carries what the
rare ops (a load, a cache) need back from every rank. As in vLLM, the state is per process (`get_tp_group`),
set once at start.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from executor_service.errors import EngineUnavailable
from executor_service.parallel.all_reduce import (
    choice,
    forget_all_reduce,
    one_shot_limit,
    pushes_rows,
    set_up_all_reduce,
)
from executor_service.parallel.channel import ControlRing
from executor_service.parallel.fused_all_reduce import forget_fused, set_up_fused

FLAG = "--tensor-parallel-size"
MAX_TENSOR_PARALLEL_SIZE = 64
# A step's collectives finish in seconds; a dead peer on NCCL is noticed at this timeout at the latest.
STEP_TIMEOUT = timedelta(minutes=5)
# The gloo group of the rare ops: a load's body and every rank's answer (a load may take long on one rank).
CONTROL_TIMEOUT = timedelta(hours=2)


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment (ValueError naming the variable otherwise)."""
    raw = os.environ.get(name)
    value = float(raw) if raw else default
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {raw!r}")
    return value


# Rank 0's watchdog (launcher.py): a step op (forward, logits, K/V move, graph replay) in flight longer than
# this breaks the group (a collective that will never meet: far below STEP_TIMEOUT); a follower whose
# heartbeat (channel.py) is older than HEARTBEAT_TIMEOUT does too (frozen, or gone).
STEP_WATCHDOG_ENV, HEARTBEAT_ENV = "SPECDEC_TP_STEP_WATCHDOG_S", "SPECDEC_TP_HEARTBEAT_TIMEOUT_S"
STEP_WATCHDOG_S, HEARTBEAT_TIMEOUT_S = 60.0, 5.0


class RankUnavailable(EngineUnavailable):
    """A tensor-parallel rank is gone: no step can run again until the server is restarted."""


@dataclass
class TensorParallelGroup:
    rank: int
    world_size: int
    device: torch.device
    control: dist.ProcessGroup | None = None  # gloo: what the rare ops need back from every rank (protocol.py)
    ring: ControlRing | None = None  # rank 0's op messages (channel.py)
    lock: threading.Lock = field(default_factory=threading.Lock)  # rank 0: one op on the wire at a time
    failure: str | None = None  # why the group can no longer run steps
    all_reduce: str = ""  # what the target's all-reduces use (all_reduce.py)
    step_since: float | None = None  # rank 0: when the step op in flight began (the step watchdog)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason[:500]

    def wait_for_followers(self) -> None:
        """Between polls while rank 0 waits on the followers (a full ring): raises once the group has failed."""
        self.check_alive()
        time.sleep(50e-6)

    def check_alive(self) -> None:
        if self.failure is not None:
            raise RankUnavailable(f"tensor parallelism is broken: {self.failure}; restart the executor")


_group: TensorParallelGroup | None = None


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, device: torch.device, ring: ControlRing | None = None
) -> TensorParallelGroup:
    """Join the group (every rank calls it with the same world size and init method)."""
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # N ranks on one CPU: share its cores instead of each taking all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=STEP_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, world_size, device, control, ring)
    _group.all_reduce = set_up_all_reduce(device, world_size)
    wanted = choice()
    push = pushes_rows(wanted)
    if wanted in ("auto", "push", "signal") and set_up_fused(device, world_size, one_shot_limit(), push=push):
        pushed = " (pushed)" if push else ""
        _group.all_reduce += f"; fused with the norm after it up to the one-shot limit{pushed}"
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


def destroy_tensor_parallel(timeout_s: float = 10.0) -> bool:
    """Leave the group; True when it was torn down within `timeout_s`. On CUDA the communicators are aborted, not
    finalized: NCCL's finalize waits until the CUDA graphs that captured its collectives are destroyed (and for
    its peers), so a rank stopping with its graphs alive waited forever (seen at TP 2 with graphs). Every op has
    finished by then (STOP comes between steps). A broken group is left to the process's exit, which aborts it."""
    global _group
    group, _group = _group, None
    forget_all_reduce()
    forget_fused()
    if not dist.is_initialized():
        return True
    if group is not None and group.failure is not None:
        return False
    done = threading.Event()

    def leave() -> None:
        if group is not None and group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:  # an older torch: the exit aborts them
                abort()
        else:
            dist.destroy_process_group()
        done.set()

    threading.Thread(target=leave, name="specdec-tp-leave", daemon=True).start()
    return done.wait(timeout_s)


def check_tensor_parallel_size(size: int) -> None:
    """The flag itself, at start: ValueError (the CLI's bad-setup exit) naming it."""
    if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE:
        raise ValueError(f"{FLAG} must be between 1 and {MAX_TENSOR_PARALLEL_SIZE}, not {size}")
