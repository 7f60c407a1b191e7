"""The kernels of eager passes compiled at load, not on a caller's step.

Capturing CUDA graphs compiles every kernel a captured step runs. Passes that run eagerly (a prompt chunk, a flush
of held drafter context, a step of the host path) come in any batch and row count, and Triton compiles a kernel
once per specialisation: the step that meets a new one stalls for about a second (an H200: 0.8-1.2 s for the
paged-attention kernel). Adaptive speculation's flushes met one at almost every flush (2026-11-29).

The specialisations are few by design: the integer sizes that change every step are not specialised
(do_not_specialize in the kernels), the attention kernel's constexprs take four tile classes and the prefill tile,
split or not (kernels/triton_attn_config.py), and a fused GEMM takes one config per power-of-two row bucket up to
MAX_ROWS (kernels/small_gemm_table.py). So at load each model's eager forward runs once for each shape that meets a
class no earlier shape met, over metadata that reads block 0 and writes no cache slot: `warm_up_shapes` finds them
by asking the functions the kernels' launches ask. A Triton kernel compiled once is also on disk, where a restart
finds it (H200, SmolLM2's shape and an EAGLE-3 drafter: the phase took 7.2 s on a first start, 3.0 s on a restart,
the sampler graphs' capture included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from executor_service.models.attention_step import AttentionStep, build_attention_step
from executor_service.models.config import ModelConfig
from kernels.small_gemm_table import MAX_ROWS, rows_bucket
from kernels.triton_attn_config import MIN_SPLIT_LEN, LaunchConfig, choose_config

if TYPE_CHECKING:
    from executor_service.runner.model_runner import ModelRunner
    from executor_service.spec_decode.proposer import DraftPass, Proposer

# (the step's metadata, positions, requests) -> None: one model's eager forward over dummy inputs
EagerForward = Callable[[AttentionStep, torch.Tensor, int], None]


@dataclass(frozen=True)
class WarmUpShape:
    """`num_requests` requests of `query_len` new tokens each, after `context` tokens each."""

    num_requests: int
    query_len: int
    context: int

    @property
    def tokens(self) -> int:
        return self.num_requests * self.query_len


@dataclass(frozen=True)
class Geometry:
    """What a launch's choices read of a model's attention on this rank: its cache's KV heads, query heads per KV
    head, head size, and the cache's bytes per element."""

    num_kv_heads: int
    group: int
    head_size: int
    itemsize: int

    @staticmethod
    def of(config: ModelConfig, k_cache: torch.Tensor) -> Geometry:
        """From the model's config and one layer's K cache [blocks, block size, KV heads, head size]."""
        return Geometry(k_cache.shape[2], config.num_heads // config.num_kv_heads, k_cache.shape[3], k_cache.itemsize)


def launch_classes(shape: WarmUpShape, geometry: Geometry, device: torch.device) -> tuple[LaunchConfig, int | None]:
    """(the attention kernel's config, less its launch-only program count; the fused GEMMs' row bucket, None
    past MAX_ROWS, cuBLAS's): what decides which compiled kernels a pass of this shape runs."""
    head_pad = max(16, 1 << (geometry.head_size - 1).bit_length())  # the kernel's HEAD_PAD
    config = choose_config(
        shape.num_requests, geometry.num_kv_heads, geometry.group, shape.query_len, shape.context + shape.query_len,
        head_pad, device, geometry.itemsize,
    )  # fmt: skip
    bucket = rows_bucket(shape.tokens) if shape.tokens <= MAX_ROWS else None
    return replace(config, split_programs=None), bucket


def warm_up_shapes(geometry: Geometry, max_model_len: int, max_batch: int, device: torch.device) -> list[WarmUpShape]:
    """Shapes that between them meet every attention class and GEMM bucket an eager pass can meet, each meeting
    one that the shapes before it did not: one request of every query length up to the prefill tile's and past the
    GEMM buckets (or the model's length), with no context and with a context that splits; then decode-shaped
    batches for buckets none of those had, and rows past the buckets where one request cannot have them."""
    longest = max(128 // max(1, geometry.group) + 1, MAX_ROWS + 1)  # past the small tiles and the GEMM buckets
    longest = min(longest, max_model_len)
    candidates = [WarmUpShape(1, q, context) for context in (0, 2 * MIN_SPLIT_LEN) for q in range(1, longest + 1)]
    candidates += [WarmUpShape(n, 1, 0) for n in (1 << i for i in range(MAX_ROWS.bit_length())) if n <= max_batch]
    candidates.append(WarmUpShape(min(max_batch, -(-(MAX_ROWS + 1) // longest)), longest, 0))  # a short model's
    shapes: list[WarmUpShape] = []
    configs: set[LaunchConfig] = set()
    buckets: set[int | None] = set()
    for shape in candidates:
        if shape.context + shape.query_len > max_model_len:
            continue
        config, bucket = launch_classes(shape, geometry, device)
        if config in configs and bucket in buckets:
            continue
        configs.add(config)
        buckets.add(bucket)
        shapes.append(shape)
    return shapes


def dummy_step(backend: str, shape: WarmUpShape, block_size: int, device: torch.device) -> AttentionStep:
    """Causal metadata of `shape` whose every block is block 0 and whose tokens are stored nowhere (slot -1), as a
    padded request of a CUDA graph: the pass reads whatever block 0 holds and writes no cache."""
    seq_len = shape.context + shape.query_len
    blocks = [[0] * -(-seq_len // block_size)] * shape.num_requests
    return build_attention_step(
        backend, blocks, [shape.query_len] * shape.num_requests, [seq_len] * shape.num_requests,
        [-1] * shape.tokens, True, device,
    )  # fmt: skip


@torch.inference_mode()
def warm_up_eager(
    forward: EagerForward, geometry: Geometry, backend: str, block_size: int, max_model_len: int, max_batch: int,
    device: torch.device,
) -> list[WarmUpShape]:  # fmt: skip
    """Run `forward` once per warm-up shape; the shapes it ran."""
    shapes = warm_up_shapes(geometry, max_model_len, max_batch, device)
    for shape in shapes:
        step = dummy_step(backend, shape, block_size, device)
        positions = torch.arange(shape.context, shape.context + shape.query_len, device=device)
        forward(step, positions.repeat(shape.num_requests), shape.num_requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return shapes


# Compiled flex_attention compiles through dynamo once per set of shapes (kernels/flex_attn.py): warming it would
# spend its compiles on shapes no caller sent, so a model on it is not warmed.
UNWARMED_BACKENDS = frozenset({"FLEX_ATTENTION"})


def warm_up_models(runner: ModelRunner, proposer: Proposer | None, max_model_len: int, max_batch: int) -> int:
    """The target's eager forward and the drafter's context passes (a prompt chunk's, a flush's), each over its
    warm-up shapes (not on a backend of UNWARMED_BACKENDS); the forwards run."""
    runs = 0
    limits = max_model_len, max_batch, runner.device
    if runner.backend not in UNWARMED_BACKENDS:
        geometry = Geometry.of(runner.model.config, runner.kv_cache.layers[0][0])
        runs += len(warm_up_eager(target_forward(runner), geometry, runner.backend, runner.block_size, *limits))
    if proposer is None or proposer.backend in UNWARMED_BACKENDS:
        return runs
    geometry = Geometry.of(proposer.config.model, proposer.kv_cache.layers[0][0])
    for forward in context_pass_forwards(proposer, runner.device):
        runs += len(warm_up_eager(forward, geometry, proposer.backend, proposer.kv_cache.block_size, *limits))
    return runs


def context_pass_forwards(proposer: Proposer, device: torch.device) -> list[EagerForward]:
    """The drafter's passes over host-built metadata (not the ones that build their own; the one-row variants are
    the same forwards)."""
    passes = proposer.passes.items()
    return [_pass_forward(p, device) for name, p in passes if p.request_inputs is None and not name.endswith(" row")]


def target_forward(runner: ModelRunner) -> EagerForward:
    """The target over zero token ids, logits of each request's last row (a prompt chunk's)."""

    def forward(step: AttentionStep, positions: torch.Tensor, count: int) -> None:
        tokens, device = positions.shape[0], positions.device
        last = torch.arange(1, count + 1, device=device) * (tokens // count) - 1
        runner.forward(torch.zeros(tokens, dtype=torch.int64, device=device), positions, step, last)

    return forward


def _pass_forward(draft_pass: DraftPass, device: torch.device) -> EagerForward:
    """A drafter pass over zero inputs of its declared shapes."""

    def forward(step: AttentionStep, positions: torch.Tensor, count: int) -> None:
        tokens = positions.shape[0]
        inputs = draft_pass.inputs.items()
        x = {name: torch.zeros(tokens, *shape, dtype=dtype, device=device) for name, (shape, dtype) in inputs}
        draft_pass.forward(step, positions, x)

    return forward
