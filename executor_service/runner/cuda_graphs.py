"""CUDA graphs for uniform steps: every request brings the same number of query tokens (decode: 1,
verify: k + 1, a drafter's context pass: k + 1, the device-resident speculative step: k + 1; the EAGLE chain
and the DFlash block: one position per request, from which they build their own metadata). One graph per
batch-size bucket.

A decode step of an 8B model launches ~1000 small kernels; launched one by one from Python, the host
needs several times longer than the GPU needs to run them. Replaying a captured graph costs one launch.
Inputs live in static buffers that each replay overwrites, attention metadata included (positions,
seq_lens, slot_mapping and block table are copied in before every replay; passes that advance their own
metadata derive it on the device from these inputs). A batch is padded up to its bucket with requests that
write nothing (slot -1) and read only their own query. Attention is captured with `max_seq_len` set to the
context length, so one graph serves every sequence length.

Under tensor parallelism a `GraphLockstep` (parallel/graphs.py) makes the other ranks capture the same buckets
and replay the same one each time; every pass starts with a broadcast of rank 0's static inputs (captured in
the graph), so the collectives captured in the graphs meet on the same inputs. The CPU has no
graphs: there a "graph" reruns the forward from the static buffers on replay (`EagerReplay`), which lets the
buffers and the ranks' lockstep be tested on the CPU.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch

from executor_service.models.attention_step import AttentionStep
from executor_service.models.draft_config import MAX_SPECULATIVE_TOKENS
from executor_service.models.limits import MAX_DFLASH_BLOCK_SIZE

log = logging.getLogger("specdec.executor")

# Backends whose kernels are capture-safe: no host syncs, no host-dependent launch shapes beyond the
# bounds given at capture (checked on an H100: graph and eager decode give the same tokens). Flex builds
# its block mask with data-dependent shapes and runs eagerly.
GRAPH_BACKENDS = frozenset({"TRITON_ATTN", "FLASH_ATTN"})

# Positions a drafter writes past the verified tokens, at most (DraftConfig.positions_ahead: k + 1 for EAGLE,
# the block for DFlash), from the bounds LoadModel enforces.
MAX_LOOKAHEAD = max(MAX_SPECULATIVE_TOKENS + 1, MAX_DFLASH_BLOCK_SIZE)

# (attention metadata, positions, named per-token and per-request inputs) -> output tensors
GraphForward = Callable[[AttentionStep, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
# name -> (trailing shape, dtype) of a per-token input; per-request inputs add the value padded requests hold
TokenInputs = dict[str, tuple[tuple[int, ...], torch.dtype]]
RequestInputs = dict[str, tuple[tuple[int, ...], torch.dtype, int]]


class GraphLockstep(Protocol):
    """Other processes whose graphs capture and replay with these ones (tensor parallelism)."""

    def capturing(self, graphs: StepGraphs) -> AbstractContextManager[None]:
        """Around the capture of every bucket."""
        ...

    def replaying(self, graphs: StepGraphs, size: int) -> AbstractContextManager[None]:
        """Around one replay of bucket `size`, rank 0's static inputs filled."""
        ...

    def share_inputs(self, graphs: StepGraphs, size: int) -> None:
        """The first operation of every pass of bucket `size` (captured): rank 0's static inputs to every rank."""
        ...


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector off while graphs are captured: an object it frees mid-capture (a pinned host
    buffer, an event of another pass) may call into CUDA from the capturing thread, which invalidates the capture.
    One collection first, so that nothing is left waiting."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_batch + 1, 16)]
    return sorted({min(s, max_batch) for s in sizes})


class StepGraphs:
    def __init__(
        self,
        name: str,
        forward: GraphForward,
        backend: str,
        query_len: int,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        inputs: TokenInputs,
        request_inputs: RequestInputs | None = None,
        lockstep: GraphLockstep | None = None,
    ) -> None:
        """`inputs`: name -> (trailing shape, dtype) of each per-token input besides positions;
        `request_inputs`: likewise per request, with the value a padded request holds (a slot: -1)."""
        self.name, self.forward, self.backend, self.device = name, forward, backend, device
        self.lockstep = lockstep
        self.query_len, self.max_model_len = query_len, max_model_len
        self.buckets = self._buckets(max_batch)
        top = self.buckets[-1]
        tokens = self._tokens(top)
        max_blocks = -(-(max_model_len + MAX_LOOKAHEAD) // block_size)  # blocks reserved past the context
        self.inputs = {
            n: torch.zeros(tokens, *shape, dtype=dtype, device=device) for n, (shape, dtype) in inputs.items()
        }
        self.request_inputs = {
            n: torch.full((top, *shape), pad, dtype=dtype, device=device)
            for n, (shape, dtype, pad) in (request_inputs or {}).items()
        }
        self.pads = {n: pad for n, (_, _, pad) in (request_inputs or {}).items()}
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((top,), query_len, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device) * query_len
        self.graphs: dict[int, torch.cuda.CUDAGraph | EagerReplay] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.pool: object | None = None  # the memory pool its graphs were captured into (CUDA), for others to share

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _buckets(self, max_batch: int) -> list[int]:
        """The batch sizes captured."""
        return batch_buckets(max_batch)

    def _tokens(self, size: int) -> int:
        """Rows a pass of `size` requests computes: `query_len` each."""
        return size * self.query_len

    @torch.inference_mode()
    def capture(self, pool: object | None = None) -> None:
        with self.lockstep.capturing(self) if self.lockstep is not None else nullcontext():
            if self.device.type == "cuda":
                self._capture_all(pool)
            else:
                for size in reversed(self.buckets):  # the same passes as on CUDA: warm-up, then capture
                    self._run_eager(size)
                    self.outputs[size] = self._run_eager(size)
                    self.graphs[size] = EagerReplay(self, size)

    def _capture_all(self, pool: object | None) -> None:
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with collector_paused():
            for size in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                self._run_eager(size)  # warm up: compile kernels, settle allocations
                torch.cuda.synchronize()
                try:
                    self.graphs[size] = self._capture_one(size, pool)
                except RuntimeError as err:  # torch.AcceleratorError is one: an invalidated capture, seen rarely
                    if self.lockstep is not None:  # a capture again here alone would run its collectives out of step
                        raise
                    log.warning("capturing %s (batch %d) failed, capturing again: %s", self.name, size, err)
                    torch.cuda.synchronize()
                    # A capture that failed leaves its pool marked as recording (PyTorch never ends it), so every
                    # later capture into that pool is refused: the rest capture into a pool of their own.
                    pool = torch.cuda.graph_pool_handle()
                    self.graphs[size] = self._capture_one(size, pool)
        torch.cuda.synchronize()
        self.pool = pool
        log.info("captured %s graphs", self.name, extra={"batch_sizes": self.buckets, "query_len": self.query_len})

    def _capture_one(self, size: int, pool: object) -> torch.cuda.CUDAGraph:
        """One bucket's graph. Thread-local capture mode: another thread's CUDA calls meanwhile (the gRPC loop,
        another session's engine, a pinned buffer freed elsewhere) cannot invalidate this capture."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs[size] = self._run_eager(size)
        return graph

    def _run_eager(self, size: int) -> tuple[torch.Tensor, ...]:
        if self.lockstep is not None:
            self.lockstep.share_inputs(self, size)
        tokens = self._tokens(size)
        step = AttentionStep(
            backend=self.backend,
            block_table=self.block_table[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=self.query_len,
            max_seq_len=self.max_model_len,
        )  # causal: a non-causal pass (DFlash's block) builds its own metadata from the inputs
        inputs = {n: t[:tokens] for n, t in self.inputs.items()} | {n: t[:size] for n, t in self.request_inputs.items()}
        return self.forward(step, self.positions[:tokens], inputs)

    def run(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        **inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Outputs for the first `len(seq_lens)` requests (token-wise outputs: their rows only). Token-wise inputs
        cover the requests' rows; a lone request may bring fewer than `query_len` (prefill_graphs.py), the rows
        after them padding that stores nothing."""
        count = seq_lens.shape[0]
        size = self._bucket(count)
        tokens, padded = slot_mapping.shape[0], size * self.query_len
        self.slot_mapping[:tokens].copy_(slot_mapping)
        self.slot_mapping[tokens:padded].fill_(-1)
        self.seq_lens[:count].copy_(seq_lens)
        self.seq_lens[count:size].fill_(self.query_len)
        return self.replay(block_table, positions, **inputs)

    def replay(
        self, block_table: torch.Tensor, positions: torch.Tensor, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """`run` for forwards that build their attention metadata on the device from their inputs: only the
        block table, positions and inputs are copied in. Padded requests' per-request inputs get their pad."""
        count = block_table.shape[0]
        size = self._bucket(count)
        tokens, padded = positions.shape[0], size * self.query_len
        for name, value in inputs.items():
            if name in self.request_inputs:
                self.request_inputs[name][:count].copy_(value)
                self.request_inputs[name][count:size].fill_(self.pads[name])
            else:
                self.inputs[name][:tokens].copy_(value)
        self.positions[:tokens].copy_(positions)
        self.positions[tokens:padded].zero_()  # padded requests: short, so device-built seq_lens read little
        self.block_table[:count, : block_table.shape[1]].copy_(block_table)
        lockstep = self.lockstep.replaying(self, size) if self.lockstep else nullcontext()
        with lockstep:
            self.graphs[size].replay()
        return tuple(_first_rows(out, size, count) for out in self.outputs[size])

    def _bucket(self, count: int) -> int:
        return next(s for s in self.buckets if s >= count)

    def target_inputs(self, size: int) -> list[torch.Tensor]:
        """The static inputs a target pass of bucket `size` reads, as views: positions, slots, sequence lengths,
        the bucket's block table (every column, so that no rank reads a stale one another rank does not) and
        input ids: what the other ranks receive from rank 0's."""
        padded = size * self.query_len
        views = [self.positions[:padded], self.slot_mapping[:padded], self.seq_lens[:size]]
        return [*views, self.block_table[:size], self.inputs["input_ids"][:padded]]


class EagerReplay:
    """A CPU "graph": replay runs the forward again from the static buffers. Its outputs are new tensors, as
    eager calls' are (the CPU path keeps a step's result while the next one runs: PendingStep)."""

    def __init__(self, graphs: StepGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    @torch.inference_mode()
    def replay(self) -> None:
        self.graphs.outputs[self.size] = self.graphs._run_eager(self.size)


def _first_rows(output: torch.Tensor, size: int, count: int) -> torch.Tensor:
    """An output of `size` padded requests cut to the first `count`: token-wise or request-wise rows."""
    if output.dim() == 0:
        return output
    return output[: count * (output.shape[0] // size)]
