"""The target's all-reduces: NCCL, or a one-shot all-reduce through symmetric memory for small tensors.

A decode step all-reduces 2 x layers + 1 times (o_proj, down_proj, the embedding), each only batch x hidden
elements: 8 KiB at batch 1, 256 KiB at batch 32 for an 8B model. NCCL's ring (its LL protocol at these sizes)
took ~7 us at 8 KiB and ~17 us at 256 KiB on 2x H200, over 1 ms of a batch-32 step. A one-shot all-reduce has
every rank copy its part into a buffer the other ranks can read (symmetric memory: PyTorch maps each rank's
buffer into its peers' address space), meet at a barrier, and read and sum every peer's part itself over NVLink:
one kernel, no ring steps. It pays for small tensors only (each rank reads N - 1 whole copies), so tensors above
ONE_SHOT_MAX_BYTES (prefill chunks) stay on NCCL. It needs peer-to-peer loads, not NVLink multicast, which stays
off on hosts that disable it (TORCH_SYMM_MEM_DISABLE_MULTICAST=1). PyTorch's kernel ends with a second barrier,
so one buffer serves every call: no rank refills it while a peer still reads it.

SPECDEC_TP_ALL_REDUCE picks: `auto` (default: one-shot where symmetric memory sets up on CUDA, else NCCL),
`nccl`, or `one-shot` (an error if it cannot be set up). Every rank reads the same environment (the followers
inherit rank 0's), and the ranks agree on the outcome before the first forward.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("specdec.executor")

ENV = "SPECDEC_TP_ALL_REDUCE"
CHOICES = ("auto", "nccl", "one-shot")
ONE_SHOT_MAX_BYTES = 512 * 1024  # batch 64 of an 8B model's hidden states in bf16; prefill chunks go to NCCL
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class OneShotAllReduce:
    """One symmetric buffer per float dtype, set up on every rank at once (a collective rendezvous)."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name, self.max_bytes = group_name, max_bytes
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in DTYPES:
            buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group_name)
            self.buffers[dtype] = buffer
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype in self.buffers and x.is_contiguous() and 0 < x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of `x`, in a new tensor (`x` is left as it was)."""
        staged = self.buffers[x.dtype][: x.numel()].view_as(x)
        out = torch.empty_like(x)
        if self._copy_out is not None:  # the copy into the buffer inside the same kernel
            self._copy_out(staged, x, "sum", self.group_name, out)
        else:
            staged.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out


_one_shot: OneShotAllReduce | None = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks: one-shot for a small tensor where set up, else NCCL's (or gloo's) in place."""
    if _one_shot is not None and _one_shot.takes(x):
        return _one_shot(x)
    dist.all_reduce(x)
    return x


def all_reduce_kind() -> str:
    """What the target's all-reduces use in this process (benchmarks and logs report it)."""
    if _one_shot is None:
        return "nccl" if dist.is_initialized() and dist.get_backend() == "nccl" else "gloo"
    return f"one-shot up to {_one_shot.max_bytes // 1024} KiB, nccl above"


def choice() -> str:
    raw = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, not {raw[:40]!r}")
    return raw


def set_up_all_reduce(device: torch.device, world_size: int) -> str:
    """Called by every rank right after joining the group: the one-shot path where chosen and possible, the
    same on every rank (a rank that could not set it up makes every rank use NCCL). Returns all_reduce_kind()."""
    global _one_shot
    _one_shot = None
    wanted = choice()
    if device.type != "cuda" or world_size < 2 or wanted == "nccl":
        return all_reduce_kind()
    one_shot, reason = None, ""
    try:
        one_shot = OneShotAllReduce(dist.group.WORLD.group_name, device)
    except Exception as err:  # an old torch, no peer access: NCCL does the same job, slower
        reason = f"{type(err).__name__}: {str(err)[:200]}"
    ready = torch.tensor([1 if one_shot is not None else 0], device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if int(ready.item()) == 1:
        _one_shot = one_shot
    elif wanted == "one-shot":
        raise RuntimeError(f"{ENV}=one-shot, but symmetric memory could not be set up on every rank {reason}")
    else:
        log.warning("tensor parallelism: one-shot all-reduce unavailable (%s); NCCL's all-reduce instead", reason)
    return all_reduce_kind()


def forget_all_reduce() -> None:
    """On leaving the group: the symmetric buffers go with it."""
    global _one_shot
    _one_shot = None
