"""Sampling as tensor work with no host decisions, so that it runs inside a captured step: each request's settings
as tensors, the distribution it samples from, and counter-based random numbers.

The distribution is sampling.target_logprobs (vLLM's recipe: temperature, min-p, top-k, then top-p), each row
with its own values read from `SamplingTensors.params`. Top-k and top-p need each row sorted; a step whose
requests set neither skips the sort (`needs_sort`, decided on the host per step, a separate captured graph).

Random numbers are counter-based: each is a hash of (the request's seed, a per-step key, an index, a stream).
The step key is a position: the draw of the token at position p + 1 is keyed by p, whether it is drawn by a decode
step or at a verify row (StepKeys). So a seeded request draws the same numbers alone or in any batch, in a graph
or eagerly, on the host path or the device step, with or without drafts, with no generator per request and no
launch per request. The hash is 32-bit "lowbias32"
(a multiply-xorshift mix), computed in int64 arithmetic that never overflows, so CPU and GPU agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from executor_service.models.attention_step import to_device
from executor_service.models.fused_ops import argmax
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.sampling import MIN_TEMPERATURE, SamplingSettings, needs_sort, sampling_params

MASK32 = 0xFFFFFFFF
# Drafts drawn from q: their acceptance uniforms (keyed by the root's position); every row's draw: its exponential
# noise (keyed by the position before the token drawn: StepKeys); a sampled draft's noise (keyed by the position the
# draft is for: draft_sampling.py).
UNIFORM_STREAM, NOISE_STREAM, DRAFT_STREAM = 1, 2, 3


@dataclass(frozen=True)
class SamplingTensors:
    """The settings of B requests, on the device: `params` [B, 4] fp32 (sampling.sampling_params: temperature,
    top-k, top-p, min-p; temperature 0 is greedy) and `seed` [B] int64."""

    params: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def build(cls, settings: list[SamplingSettings], seeds: list[int], device: torch.device) -> SamplingTensors:
        params = to_device(sampling_params(settings), torch.float32, device).reshape(len(settings), 4)
        return cls(params, to_device([seed_value(s) for s in seeds], torch.int64, device))

    @property
    def temperature(self) -> torch.Tensor:
        return self.params[:, 0]

    @property
    def greedy(self) -> torch.Tensor:
        return self.params[:, 0] < MIN_TEMPERATURE

    def inputs(self) -> dict[str, torch.Tensor]:
        """As a step's per-request inputs (cuda_graphs.StepGraphs copies them in before a replay)."""
        return {"sampling": self.params, "seed": self.seed}

    @classmethod
    def from_inputs(cls, x: dict[str, torch.Tensor]) -> SamplingTensors | None:
        return cls(x["sampling"], x["seed"]) if "sampling" in x else None


# Per-request inputs of a sampled step's graphs: name -> (shape, dtype, what a padded request holds).
SAMPLING_INPUTS = {"sampling": ((4,), torch.float32, 0), "seed": ((), torch.int64, 0)}

# A device step's variants, each its own captured graph: every request greedy (the argmax alone); some sampled;
# some sampled with top-k or top-p (every verify row sorted once); and either of the two with penalties and
# logprobs (device_penalties.py), for batches where some request sets a penalty or asks for logprobs.
GREEDY, SAMPLED, SORTED = "greedy", "sampled", "sorted"
EXTRAS, EXTRAS_SORTED = "extras", "extras sorted"
VARIANTS = (GREEDY, SAMPLED, SORTED, EXTRAS, EXTRAS_SORTED)


def step_variant(settings: list[SamplingSettings], vocab: int) -> str:
    if all(s.plain_greedy for s in settings):
        return GREEDY
    sort = needs_sort(settings, vocab)
    if any(s.has_penalties or s.logprobs is not None for s in settings):
        return EXTRAS_SORTED if sort else EXTRAS
    return SORTED if sort else SAMPLED


def sorts(variant: str) -> bool:
    return variant in (SORTED, EXTRAS_SORTED)


def has_extras(variant: str) -> bool:
    """Whether a variant's step penalises its rows and returns logprobs."""
    return variant in (EXTRAS, EXTRAS_SORTED)


Key = TypeVar("Key", torch.Tensor, int)  # the hash runs on int64 tensors, or on the host's Python integers alike


def mix32(x: Key) -> Key:
    """lowbias32 of int64 values in [0, 2^32): two multiply-xorshift rounds."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: Key, constant: int) -> Key:
    """x * constant mod 2^32, in halves so that no int64 product overflows."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def step_keys(seed: Key, step_key: Key, stream: int) -> Key:
    """[B] one 32-bit key per request, step and stream; on Python integers, one request's, bit for bit the same
    (the host path knows every seed and position, so its keys cost one copy instead of some fifty launches)."""
    key = mix32((seed & MASK32) ^ mix32((seed >> 32) & MASK32))
    key = mix32(key ^ (step_key & MASK32))
    return mix32(key ^ stream)


def seed_value(seed: int) -> int:
    """A request's seed as its random numbers read it (63 bits: an int64 tensor holds it)."""
    return seed & (2**63 - 1)


@dataclass(frozen=True)
class StepKeys:
    """A verify step's keys. `noise` [B, D + 1]: the draw of the token after a row at depth j (the token for
    position root + j + 1) is keyed by root + j, the key target-only decoding uses for that same token, so a
    request's sampled tokens are the ones it would draw without drafts. `uniform` [B] (None unless asked for):
    the acceptance tests of drafts drawn from the drafter's q (verifier.py), keyed by the root."""

    uniform: torch.Tensor | None
    noise: torch.Tensor

    @classmethod
    def on_device(
        cls,
        seed: torch.Tensor,
        root: torch.Tensor,
        depth: int = 0,
        q_drafts: bool = False,
        constants: StepConstants | None = None,
    ) -> StepKeys:
        """From seeds and root positions on the device (a device step derives its roots there), for drafts up to
        `depth` deep; `q_drafts`: with the uniforms of drafts drawn from q; `constants`: the step's (the depths'
        arange built once, not a kernel of each replay)."""
        positions = root[:, None]
        if depth:
            positions = positions + (constants or StepConstants(root.device)).arange(depth + 1)[None, :]
        (noise,) = position_keys(seed, positions, (NOISE_STREAM,))
        uniform = position_keys(seed, root, (UNIFORM_STREAM,))[0] if q_drafts else None
        return cls(uniform, noise.view(-1, depth + 1))

    @classmethod
    def on_host(
        cls, seeds: list[int], roots: list[int], device: torch.device, depth: int = 0, q_drafts: bool = False
    ) -> StepKeys:
        """From seeds and root positions the host holds: one copy."""
        pairs = [(seed_value(s), r) for s, r in zip(seeds, roots, strict=True)]
        keys = [step_keys(s, r + j, NOISE_STREAM) for s, r in pairs for j in range(depth + 1)]
        keys += [step_keys(s, r, UNIFORM_STREAM) for s, r in pairs] if q_drafts else []
        found = to_device(keys, torch.int64, device)
        noise = found[: len(seeds) * (depth + 1)].view(len(seeds), depth + 1)
        return cls(found[len(seeds) * (depth + 1) :] if q_drafts else None, noise)


def hash_kernels_take(tensor: torch.Tensor) -> bool:
    """Whether the hash runs as the Triton kernels for this tensor: on GPUs (a test may also route the CPU's
    through them under Triton's interpreter)."""
    return tensor.is_cuda


def position_keys(seed: torch.Tensor, positions: torch.Tensor, streams: tuple[int, ...]) -> list[torch.Tensor]:
    """step_keys of seeds [B] and positions [B] or [B, n] (each row the seed's), per stream, flat [B * n]: on GPUs
    one kernel a stream instead of ~50 ops (sample/hash_kernels.py, the same bits)."""
    if hash_kernels_take(positions):
        from executor_service.sample.hash_kernels import launched, triton_step_keys

        flat = positions.contiguous().view(-1)
        keys = launched(lambda: triton_step_keys(seed.contiguous(), flat, streams))
        if keys is not None:
            return list(keys)
    rows = seed if positions.dim() == 1 else seed[:, None]
    return [step_keys(rows, positions, stream).reshape(-1) for stream in streams]


def uniforms(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count] uniforms in (0, 1) from keys [B]: the hash of each key and index, 24 bits of it (on GPUs one
    kernel, sample/hash_kernels.py, the same bits)."""
    if hash_kernels_take(keys):
        from executor_service.sample.hash_kernels import launched, triton_uniforms

        drawn = launched(lambda: triton_uniforms(keys.contiguous(), count))
        if drawn is not None:
            return drawn
    index = torch.arange(count, device=keys.device)
    bits = mix32(keys[:, None] ^ (index[None, :] * 0x9E3779B9 & MASK32)) >> 8
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def exponential_noise(keys: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count] Exp(1) noise from keys [B]."""
    return -torch.log(uniforms(keys, count))


def exponential_race(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalised weights [B, V]: the argmax of w / E with E ~ Exp(1) (from keys [B]) is
    token i with probability w_i / sum(w). The fused argmax on GPUs (torch's reduces a batch-1 row in one block),
    the same first index of the maximum as torch's."""
    return argmax(weights / exponential_noise(keys, weights.shape[-1]))
