"""A sampled decode step's draw as one CUDA graph replay instead of some sixty launches.

Target-only decoding replays the model's captured step, then samples each row (verifier.verify with no drafts:
temperature, min-p, top-k / top-p, the counter-based draw, the finiteness and distribution checks). Launched op
by op, that sampling costs the host ~0.3-0.6 ms a step, as much as SmolLM2's whole batch-1 step on the GPU, and a
step cannot be launched faster than the host prepares it: sampled decoding ran at a third of greedy's tokens/s.
Here the same ops are captured once per (sorted or not, batch bucket), on first use, and replayed from static
inputs: the logits (one device copy), the settings and the random numbers' keys (two copies from pinned memory,
padded rows greedy). Same ops, same kernels: the tokens are those of the eager path bit for bit.
"""

from __future__ import annotations

import logging

import torch

from executor_service.models.fused_ops import checked_argmax
from executor_service.runner.cuda_graphs import batch_buckets, collector_paused
from executor_service.sample.device_sampling import (
    NOISE_STREAM,
    UNIFORM_STREAM,
    SamplingTensors,
    StepKeys,
    seed_value,
    step_keys,
)
from executor_service.sample.sampling import SamplingSettings, sampling_params
from executor_service.spec_decode.verifier import DraftLayout, verify

log = logging.getLogger("specdec.executor")


def draw_read_back(logits: torch.Tensor, sampling: SamplingTensors, keys: StepKeys, sort: bool | int) -> torch.Tensor:
    """[3, B] int64: each row's logits finite, its weights a distribution (greedy rows: always), its token."""
    count = logits.shape[0]
    finite = checked_argmax(logits)[1]
    empty = torch.zeros(count, 0, dtype=torch.int64, device=logits.device)
    no_drafts = DraftLayout(empty, empty, None, None, 0, chain=True, present=empty.bool())
    verdict = verify(logits, no_drafts, sampling, keys, sort, check=True)
    assert verdict.valid is not None
    return torch.stack([finite.long(), verdict.valid.long(), verdict.emitted[:, 0]])


class SamplerGraphs:
    """Draws for up to `max_batch` rows, each (sort, bucket) captured on first use into one memory pool (a step
    replays one at a time); a bucket's static inputs are allocated with its first graph. More rows than the largest
    bucket draw eagerly."""

    def __init__(self, max_batch: int) -> None:
        self.buckets = batch_buckets(max_batch)
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # logits, params, ints
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph | None] = {}  # None: its capture failed
        self.outputs: dict[tuple[bool, int], torch.Tensor] = {}
        self.pool: object | None = None

    def draw(
        self, logits: torch.Tensor, settings: list[SamplingSettings], seeds: list[int], roots: list[int], sort: bool
    ) -> torch.Tensor:
        """[3 * B] int64, [finite | a distribution | token] per row, as `eager_draw` gives them; `roots`: each row's
        position (its random numbers' key), `sort`: sampling.needs_sort of the settings."""
        count = logits.shape[0]
        size = next((s for s in self.buckets if s >= count), None)
        if size is None:
            return eager_draw(logits, settings, seeds, roots, sort)
        static_logits, params, ints = self._inputs(size, logits)
        pad = size - count
        seed_values = [seed_value(s) for s in seeds]
        uniform = [step_keys(s, r, UNIFORM_STREAM) for s, r in zip(seed_values, roots, strict=True)]
        noise = [step_keys(s, r, NOISE_STREAM) for s, r in zip(seed_values, roots, strict=True)]
        static_logits[:count].copy_(logits)
        _copy_in(params, sampling_params(settings) + [[0.0] * 4] * pad, torch.float32)  # padded rows: greedy
        _copy_in(ints, [row + [0] * pad for row in (seed_values, uniform, noise)], torch.int64)
        key = (sort, size)
        graph = self.graphs[key] if key in self.graphs else self._capture(key)
        if graph is None:
            out = self._run(key)
        else:
            graph.replay()
            out = self.outputs[key]
        packed = torch.empty(3 * count, dtype=torch.int64, device=logits.device)
        packed.view(3, count).copy_(out[:, :count])  # its own tensor: the next replay overwrites the graph's
        return packed

    def _inputs(self, size: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if size not in self.inputs:
            device = logits.device
            self.inputs[size] = (
                torch.zeros(size, logits.shape[-1], dtype=logits.dtype, device=device),
                torch.zeros(size, 4, dtype=torch.float32, device=device),
                torch.zeros(3, size, dtype=torch.int64, device=device),  # seed, uniform key, noise key
            )
        return self.inputs[size]

    def _run(self, key: tuple[bool, int]) -> torch.Tensor:
        sort, size = key
        logits, params, ints = self.inputs[size]
        return draw_read_back(logits, SamplingTensors(params, ints[0]), StepKeys(ints[1], ints[2]), sort)

    def _capture(self, key: tuple[bool, int]) -> torch.cuda.CUDAGraph | None:
        """The graph of `key`, after one eager run (Triton compiles for the shape); None where capture fails
        (that key then draws eagerly from the same buffers), and on the CPU, which has no graphs."""
        if not self.inputs[key[1]][0].is_cuda:
            self.graphs[key] = None
            return None
        self._run(key)
        torch.cuda.synchronize()
        graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        try:
            with collector_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs[key] = self._run(key)
            self.pool = graph.pool()
        except RuntimeError as err:
            log.warning("capturing the decode sampler %s failed; it draws eagerly: %s", key, err)
            torch.cuda.synchronize()
            graph = None
        self.graphs[key] = graph
        return graph


def eager_draw(
    logits: torch.Tensor, settings: list[SamplingSettings], seeds: list[int], roots: list[int], sort: bool | int
) -> torch.Tensor:
    """`SamplerGraphs.draw` launched op by op (the CPU, no graphs, more rows than the graphs take); `sort` may be
    sampling.host_sort's (top-k alone: each row's K largest instead of a sort)."""
    device = logits.device
    sampling = SamplingTensors.build(settings, seeds, device)
    return draw_read_back(logits, sampling, StepKeys.on_host(seeds, roots, device), sort).view(-1)


def _copy_in(target: torch.Tensor, values: list, dtype: torch.dtype) -> None:
    """Host values into a device buffer without waiting for the device (pinned memory, asynchronous copy)."""
    host = torch.tensor(values, dtype=dtype).view(target.shape)
    target.copy_(host.pin_memory() if target.is_cuda else host, non_blocking=True)
