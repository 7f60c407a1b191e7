"""A sampled decode step's draw as one CUDA graph replay instead of some sixty launches.

Target-only decoding replays the model's captured step, then samples each row (verifier.verify with no drafts:
temperature, min-p, top-k / top-p, the counter-based draw, the finiteness and distribution checks). Launched op
by op, that sampling costs the host ~0.3-0.6 ms a step, as much as SmolLM2's whole batch-1 step on the GPU, and a
step cannot be launched faster than the host prepares it: sampled decoding ran at a third of greedy's tokens/s.
Here the same ops are captured once per (sorted or not, extras or not, batch bucket), at load (`capture_all`),
and replayed from static inputs: the logits (one device copy), the settings and the seeds and positions the random
numbers are keyed by (two copies from pinned memory, padded rows greedy; the keys are hashed in the graph, where
the host hashed ~10 us a request a step). The same ops and the same integer hash: the eager path's tokens bit for
bit.

With extras (a batch where some request sets a penalty or a logit bias, or asks for logprobs), each row is
penalised from its slot of the penalty table first, the drawn token is counted in that slot on the device (so the
step launched before this one's read-back is penalised for it), and the raw logprobs of each drawn token and the
top ones are read back with it: the spec step's extras (spec_decode/device_penalties.py) with no drafts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from executor_service.models.fused_ops import checked_argmax
from executor_service.runner.cuda_graphs import batch_buckets, collector_paused
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.device_sampling import SamplingTensors, StepKeys, seed_value
from executor_service.sample.sampling import SamplingSettings, sampling_params
from executor_service.spec_decode.device_penalties import PenaltyTable, count_emitted, emitted_logprobs, penalty_inputs
from executor_service.spec_decode.verifier import DraftLayout, StepPenalties, verify

log = logging.getLogger("specdec.executor")


@dataclass(frozen=True)
class DecodeExtras:
    """A batch's penalties and logprobs: the table, each row's slot [B] (-1: none) and (repetition, presence,
    frequency) [B, 3]."""

    table: PenaltyTable
    slot: torch.Tensor
    penalty: torch.Tensor


def draw_read_back(
    logits: torch.Tensor,
    sampling: SamplingTensors,
    keys: StepKeys,
    sort: bool | int,
    extras: DecodeExtras | None,
    constants: StepConstants | None = None,
) -> tuple[torch.Tensor, ...]:
    """([3, B] int64: each row's logits finite, its weights a distribution (greedy rows: always), its token), and
    with `extras` each token's packed logprobs [B, W] (device_penalties.emitted_logprobs). `constants`: the graphs'
    (their index tensors built once, not in every replay)."""
    count = logits.shape[0]
    constants = constants or StepConstants(logits.device)
    ids, finite = checked_argmax(logits)
    empty = torch.zeros(count, 0, dtype=torch.int64, device=logits.device)  # size 0: no kernel
    no_drafts = DraftLayout(empty, empty, None, None, 0, chain=True, present=empty.bool())
    penalties = None
    if extras is not None:  # penalties change the argmax: verify finds it after them
        penalties = StepPenalties(extras.table, extras.slot, extras.penalty, extras.table.bias_rows(extras.slot))
    row_argmax = ids if penalties is None else None
    verdict = verify(logits, no_drafts, sampling, keys, sort, constants, penalties, check=True, row_argmax=row_argmax)
    assert verdict.valid is not None
    checks = torch.stack([finite.long(), verdict.valid.long(), verdict.emitted[:, 0]])
    if extras is None:
        return (checks,)
    count_emitted(extras.table, extras.slot, verdict.emitted, verdict.accepted, constants.arange(1))
    return checks, emitted_logprobs(logits, constants.arange(count)[:, None], verdict.emitted)


def packed(outputs: tuple[torch.Tensor, ...], count: int) -> torch.Tensor:
    """[finite (B) | a distribution (B) | token (B) | logprobs (B x W), with extras] int64, the first `count` rows of
    draw_read_back's outputs, as a tensor of its own (a graph's next replay overwrites its outputs)."""
    checks, logprobs = outputs[0], outputs[1] if len(outputs) > 1 else None
    width = logprobs.shape[1] if logprobs is not None else 0
    out = torch.empty(count * (3 + width), dtype=torch.int64, device=checks.device)
    out[: 3 * count].view(3, count).copy_(checks[:, :count])
    if logprobs is not None:
        out[3 * count :].view(count, width).copy_(logprobs[:count])
    return out


Key = tuple[bool, bool, int]  # (sorted, with extras, bucket)


class SamplerGraphs:
    """Draws for up to `max_batch` rows, each (sorted, extras, bucket) captured into one memory pool (a step replays
    one at a time), from static inputs that every bucket shares. More rows than the largest bucket draw eagerly."""

    def __init__(self, max_batch: int) -> None:
        self.buckets = batch_buckets(max_batch)
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[Key, torch.cuda.CUDAGraph | None] = {}  # None: not captured (the CPU, a failed capture)
        self.outputs: dict[Key, tuple[torch.Tensor, ...]] = {}
        self.pool: object | None = None
        self.table: PenaltyTable | None = None  # the extras' table (one object for the graphs' lives)
        self.constants: StepConstants | None = None  # the graphs' index tensors, on their device

    def draw(
        self,
        logits: torch.Tensor,
        settings: list[SamplingSettings],
        seeds: list[int],
        roots: list[int],
        sort: bool,
        extras: HostExtras | None = None,
    ) -> torch.Tensor:
        """`packed` draws of these rows, as `eager_draw` gives them; `roots`: each row's position (its random
        numbers' key), `sort`: sampling.needs_sort of the settings, `extras`: the rows' slots and penalties."""
        count = logits.shape[0]
        size = next((s for s in self.buckets if s >= count), None)
        if size is None:
            return eager_draw(logits, settings, seeds, roots, sort, extras)
        static = self._inputs(size, logits)
        pad = size - count
        seed_values = [seed_value(s) for s in seeds]
        static["logits"][:count].copy_(logits)
        _copy_in(static["params"], sampling_params(settings) + [[0.0] * 4] * pad, torch.float32)  # padded: greedy
        _copy_in(static["ints"], [seed_values + [0] * pad, roots + [0] * pad], torch.int64)
        if extras is not None:
            assert self.table is None or self.table is extras.table, "one penalty table for the graphs' lives"
            self.table = extras.table
            _copy_in(static["slot"], extras.slots + [-1] * pad, torch.int64)
            _copy_in(static["penalty"], extras.params + [(1.0, 0.0, 0.0)] * pad, torch.float32)
        key = (sort, extras is not None, size)
        graph = self.graphs[key] if key in self.graphs else self._capture(key)
        if graph is None:
            return packed(self._run(key), count)
        graph.replay()
        return packed(self.outputs[key], count)

    def capture_all(self, table: PenaltyTable) -> None:
        """Every (sorted, extras, bucket) captured now (load): a sampled decode step then neither compiles nor
        captures (one took 0.25-0.65 s on an H200, with its compiles; a benchmark round of 16 requests ~0.5 s).
        `table`: the extras' penalty table, allocated now (its slots x vocabulary: ~40 MiB for 128k ids); the
        draws read logits of its vocabulary, on its device."""
        table.allocate()
        self.table = table
        logits = torch.zeros(1, table.vocab, dtype=torch.float32, device=table.device)  # the target's logits: fp32
        for size in self.buckets:
            self._inputs(size, logits)
            for key in [(sort, extras, size) for sort in (False, True) for extras in (False, True)]:
                if key not in self.graphs:
                    self._capture(key)

    def _inputs(self, size: int, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Bucket `size`'s static inputs: the first rows of the largest bucket's (a step replays one graph at a
        time, and copies its inputs in first), allocated with the first graph."""
        if not self.inputs:
            top, device = self.buckets[-1], logits.device
            self.constants = StepConstants(device)
            self.inputs[top] = {
                "logits": torch.zeros(top, logits.shape[-1], dtype=logits.dtype, device=device),
                "params": torch.zeros(top, 4, dtype=torch.float32, device=device),
                "ints": torch.zeros(2, top, dtype=torch.int64, device=device),  # seed, root position
                "slot": torch.full((top,), -1, dtype=torch.int64, device=device),
                "penalty": torch.zeros(top, 3, dtype=torch.float32, device=device),
            }
        if size not in self.inputs:
            self.inputs[size] = {
                name: tensor[:, :size] if name == "ints" else tensor[:size]
                for name, tensor in self.inputs[self.buckets[-1]].items()
            }
        return self.inputs[size]

    def _run(self, key: Key, warm_up: bool = False) -> tuple[torch.Tensor, ...]:
        """The draw from the static inputs; `warm_up`: every row reads and counts in the scratch slot, which stays
        zero, so that the run before a capture leaves the table as it was."""
        sort, with_extras, size = key
        static = self.inputs[size]
        ints = static["ints"]
        extras = None
        if with_extras:
            assert self.table is not None
            slot = torch.full_like(static["slot"], -1) if warm_up else static["slot"]
            extras = DecodeExtras(self.table, slot, static["penalty"])
        sampling = SamplingTensors(static["params"], ints[0])
        keys = StepKeys.on_device(ints[0], ints[1])
        return draw_read_back(static["logits"], sampling, keys, sort, extras, self.constants)

    def _capture(self, key: Key) -> torch.cuda.CUDAGraph | None:
        """The graph of `key`, after one eager run (Triton compiles for the shape); None where capture fails
        (that key then draws eagerly from the same buffers), and on the CPU, which has no graphs."""
        if not self.inputs[key[2]]["logits"].is_cuda:
            self.graphs[key] = None
            return None
        self._run(key, warm_up=True)
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


@dataclass(frozen=True)
class HostExtras:
    """A batch's penalties and logprobs as the host knows them: the rows' penalty table slots (-1: none, PenaltyTable
    .slots_of) and (repetition, presence, frequency)."""

    table: PenaltyTable
    slots: list[int]
    params: list[tuple[float, float, float]]

    def on_device(self, device: torch.device) -> DecodeExtras:
        return DecodeExtras(self.table, *penalty_inputs(self.slots, self.params, device))


def eager_draw(
    logits: torch.Tensor,
    settings: list[SamplingSettings],
    seeds: list[int],
    roots: list[int],
    sort: bool | int,
    extras: HostExtras | None = None,
) -> torch.Tensor:
    """`SamplerGraphs.draw` launched op by op (the CPU, no graphs, more rows than the graphs take); `sort` may be
    sampling.host_sort's (top-k alone: each row's K largest instead of a sort)."""
    device = logits.device
    sampling = SamplingTensors.build(settings, seeds, device)
    keys = StepKeys.on_host(seeds, roots, device)
    on_device = extras.on_device(device) if extras is not None else None
    return packed(draw_read_back(logits, sampling, keys, sort, on_device), logits.shape[0])


def _copy_in(target: torch.Tensor, values: list, dtype: torch.dtype) -> None:
    """Host values into a device buffer without waiting for the device (pinned memory, asynchronous copy)."""
    host = torch.tensor(values, dtype=dtype).view(target.shape)
    target.copy_(host.pin_memory() if target.is_cuda else host, non_blocking=True)
