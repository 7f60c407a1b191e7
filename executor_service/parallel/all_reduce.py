"""The target's all-reduces: NCCL, or all-reduces through symmetric memory for small and mid-sized tensors.

A decode step all-reduces 2 x layers + 1 times (o_proj, down_proj, the embedding), each only batch x hidden
elements: 8 KiB at batch 1, 256 KiB at batch 32 for an 8B model; a verify step of k drafts k + 1 times as much
(2 MiB at batch 32, k = 7). NCCL's ring (its LL protocol at these sizes) costs a fixed ~9-10 us up to 256 KiB
and ~29 us at 2 MiB on 2x H200 (bench/all_reduce_bench.py, inside CUDA graphs).

Symmetric memory (PyTorch maps each rank's buffer into its peers' address space) gives two other ways, both
peer-to-peer loads over NVLink, no multicast (which stays off on hosts that disable it,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1):
- one-shot: every rank copies its part into its buffer, the ranks meet at a barrier, and each reads and sums
  every peer's whole part itself. One kernel; each rank reads N - 1 whole copies, so it pays for small tensors.
- two-shot: each rank sums one N-th of the tensor from every peer's buffer (a reduce-scatter) and writes it to
  every peer (an all-gather). Each rank moves about 2 / N of the tensor: the better one for mid sizes.
PyTorch's kernels end with a barrier, so one buffer serves every call: no rank refills it while a peer reads it.
Which one a size takes is SIZE_LIMITS' table, measured on 2x H200 (all_reduce_bench, per call in a graph):

| KiB | 8 | 256 | 512 | 1,024 | 2,048 | 4,096 | 8,192 |
|---|---|---|---|---|---|---|---|
| NCCL | 9.6 | 10.1 | 11.7 | 16.0 | 29.1 | 34.4 | 50.7 |
| one-shot | 7.7 | 9.9 | 11.2 | 15.3 | 22.1 | 36.4 | 64.3 |
| two-shot | 10.9 | 12.3 | 13.1 | 16.0 | 19.9 | 27.8 | 42.7 |

Above TWO_SHOT_MAX_BYTES (prefill chunks) NCCL's ring is the right tool. At 4 GPUs one-shot beat NCCL up to
512 KiB on 4x H200 (docs/benchmarks.md); two-shot's 4-GPU limits are not measured yet (the same 8 MiB as at 2).

SPECDEC_TP_ALL_REDUCE picks: `auto` (default: one-shot and two-shot by size where symmetric memory sets up on
CUDA, else NCCL; and the one-shot sizes fused with the norm after them, fused_all_reduce.py, pushing each rank's
rows to its peers, measured faster than signalling them at 2 and 4 ranks), `push` (the same as `auto`) or `signal`
(auto's, the fused kernel signalling its peers instead), `unfused` (the same all-reduces, the norm apart:
the comparison), `nccl`, or `one-shot` (one-shot alone up to its limit, NCCL above; an error if it cannot be set
up: the comparison before two-shot). Every rank reads the same environment (the followers inherit rank 0's), and
the ranks agree on the outcome before the first forward.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("specdec.executor")

ENV = "SPECDEC_TP_ALL_REDUCE"
CHOICES = ("auto", "push", "signal", "unfused", "nccl", "one-shot")
ONE_SHOT_MAX_BYTES = 512 * 1024  # batch 64 of an 8B model's hidden states in bf16
TWO_SHOT_MAX_BYTES = 8 * 1024 * 1024  # a verify step of batch 128 at k = 7 (8B); prefill chunks go to NCCL
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGN_BYTES = 16  # two-shot splits the tensor over the ranks in 16-byte vectors


def size_limits(world_size: int, two_shot: bool) -> tuple[int, int]:
    """(one-shot up to, two-shot up to) in bytes for this group: at 2 ranks one-shot reads one peer's copy and
    stays ahead of two-shot up to 1 MiB (the table above); two-shot off: both limits the one-shot one."""
    one_shot = 2 * ONE_SHOT_MAX_BYTES if world_size == 2 else ONE_SHOT_MAX_BYTES
    return one_shot, (TWO_SHOT_MAX_BYTES if two_shot else one_shot)


def route(nbytes: int, one_shot_max: int, two_shot_max: int) -> str:
    """The all-reduce for a tensor of `nbytes`: one-shot up to `one_shot_max`, two-shot (whole 16-byte vectors)
    up to `two_shot_max`, NCCL otherwise (an empty tensor too: nothing to stage)."""
    if 0 < nbytes <= one_shot_max:
        return "one-shot"
    if one_shot_max < nbytes <= two_shot_max and nbytes % ALIGN_BYTES == 0:
        return "two-shot"
    return "nccl"


class SymmetricAllReduce:
    """One symmetric buffer per float dtype, set up on every rank at once (a collective rendezvous), and the
    one-shot or two-shot kernel by size."""

    def __init__(self, group_name: str, device: torch.device, world_size: int, two_shot: bool = True) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group_name
        self.one_shot_max, self.max_bytes = size_limits(world_size, two_shot)
        if self.max_bytes > self.one_shot_max and not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out"):
            self.max_bytes = self.one_shot_max  # an older torch: one-shot alone
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in DTYPES:
            buffer = symm_mem.empty(self.max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buffer, group_name)
            self.buffers[dtype] = buffer
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    def route(self, x: torch.Tensor) -> str:
        """Which all-reduce `x` takes: "one-shot", "two-shot" or "nccl" (a dtype or layout without a buffer)."""
        if x.dtype not in self.buffers or not x.is_contiguous():
            return "nccl"
        return route(x.numel() * x.element_size(), self.one_shot_max, self.max_bytes)

    def __call__(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """The sum over the ranks of `x` by `kind` (its `route`, not "nccl"), in a new tensor (`x` is left as it
        was)."""
        staged = self.buffers[x.dtype][: x.numel()].view_as(x)
        out = torch.empty_like(x)
        if kind == "two-shot":
            staged.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)
        elif self._copy_out is not None:  # the copy into the buffer inside the same kernel
            self._copy_out(staged, x, "sum", self.group_name, out)
        else:
            staged.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)
        return out

    def describe(self) -> str:
        two_shot = f", two-shot up to {self.max_bytes // 1024} KiB" if self.max_bytes > self.one_shot_max else ""
        return f"one-shot up to {self.one_shot_max // 1024} KiB{two_shot}, nccl above"


_symmetric: SymmetricAllReduce | None = None


def all_reduce(x: torch.Tensor, keep_input: bool = False) -> torch.Tensor:
    """The sum of `x` over the ranks: through symmetric memory for a small or mid-sized tensor where set up (a new
    tensor), else NCCL's (or gloo's) in place, on a copy where `keep_input` (a partial sum still to be read)."""
    if _symmetric is not None and (kind := _symmetric.route(x)) != "nccl":
        return _symmetric(x, kind)
    if keep_input:
        x = x.clone()
    dist.all_reduce(x)
    return x


def sum_of(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks in a new tensor, `x` left as it is."""
    return all_reduce(x, keep_input=True)


def all_reduce_kind() -> str:
    """What the target's all-reduces use in this process (benchmarks and logs report it)."""
    if _symmetric is None:
        return "nccl" if dist.is_initialized() and dist.get_backend() == "nccl" else "gloo"
    return _symmetric.describe()


def choice() -> str:
    raw = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if raw not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, not {raw[:40]!r}")
    return raw


def set_up_all_reduce(device: torch.device, world_size: int) -> str:
    """Called by every rank right after joining the group: symmetric memory's all-reduces where chosen and
    possible, the same on every rank (a rank that could not set them up makes every rank use NCCL). Returns
    all_reduce_kind()."""
    global _symmetric
    _symmetric = None
    wanted = choice()
    if device.type != "cuda" or world_size < 2 or wanted == "nccl":
        return all_reduce_kind()
    symmetric, reason = None, ""
    try:
        two_shot = wanted in ("auto", "push", "signal", "unfused")
        symmetric = SymmetricAllReduce(dist.group.WORLD.group_name, device, world_size, two_shot=two_shot)
    except Exception as err:  # an old torch, no peer access: NCCL does the same job, slower
        reason = f"{type(err).__name__}: {str(err)[:200]}"
    ready = torch.tensor([1 if symmetric is not None else 0], device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if int(ready.item()) == 1:
        _symmetric = symmetric
    elif wanted == "one-shot":
        raise RuntimeError(f"{ENV}=one-shot, but symmetric memory could not be set up on every rank {reason}")
    else:
        log.warning("tensor parallelism: symmetric-memory all-reduce unavailable (%s); NCCL's instead", reason)
    return all_reduce_kind()


def pushes_rows(wanted: str) -> bool:
    """Whether the fused all-reduce + norm pushes its rows (else signals its peers): `push` or `auto`, measured
    faster at 2 and 4 ranks (8B shape, bf16, graphs; 2x H200: a batch-1 decode step 3.20 against 3.40 ms, batch 32
    3.56 against 3.99; 4x H200 at 4 ranks: 2.43 against 2.71 ms, batch 32 11,640 against 10,449 tokens/s)."""
    return wanted in ("push", "auto")


def one_shot_limit() -> int:
    """The largest tensor (bytes) the one-shot path takes in this process; 0 where it is not set up."""
    return _symmetric.one_shot_max if _symmetric is not None else 0


def forget_all_reduce() -> None:
    """On leaving the group: the symmetric buffers go with it."""
    global _symmetric
    _symmetric = None
