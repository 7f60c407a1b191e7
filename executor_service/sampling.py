"""Per-request sampling: greedy, or temperature / min-p / top-k / top-p with the request's own seeded generator.

`target_probs` is the distribution a sampled request draws from, exposed for the rejection sampler of
speculative decoding, which must accept and resample against exactly this distribution. The order is vLLM's:
penalties (penalties.py, on the logits before this), temperature, min-p, top-k, top-p. `sampled_probs` gives
the same for many rows with different settings in one pass, and `race` draws a token per row from them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from executor_service.attention_step import to_device
from specdec.v1 import executor_pb2

# Below this a temperature is greedy: logits / 1e-38 overflow float32 to inf and softmax turns them into
# NaN, while at 1e-5 the distribution is already the argmax's point mass (validation and docs/api.md).
MIN_TEMPERATURE = 1e-5


class SamplingError(RuntimeError):
    """One request's numbers gave no distribution to draw from; the engine fails that request alone."""


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: the whole vocabulary
    max_tokens: int | None = None
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    min_p: float = 0.0  # tokens below min_p x the top probability (after temperature) are dropped
    repetition_penalty: float = 1.0  # 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; n: the emitted token's and the top n (logprobs.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else read from the logits: the argmax alone decides (the device-resident step)."""
        return self.greedy and not self.has_penalties and self.logprobs is None

    @classmethod
    def from_proto(cls, params: executor_pb2.SamplingParams) -> SamplingSettings:
        return cls(
            temperature=params.temperature,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=params.top_k,
            max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
            seed=params.seed if params.HasField("seed") else None,
            stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logprobs=params.logprobs if params.HasField("logprobs") else None,
        )


def make_generator(settings: SamplingSettings, device: torch.device) -> torch.Generator | None:
    """The request's own random stream: seeded requests replay exactly, whatever else is batched."""
    if settings.greedy:
        return None
    seed = settings.seed if settings.seed is not None else random.getrandbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def target_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Softmax of logits [..., V] / temperature, restricted to min-p, the top-k and then the top-p nucleus.
    The row's maximum is subtracted first (softmax does not change): penalised logits may be as large as
    float32 allows, and dividing those by a small temperature would overflow to inf."""
    logits = logits.float()
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / settings.temperature
    vocab = scaled.shape[-1]
    if settings.min_p > 0.0:  # vLLM's MinPLogitsProcessor: relative to the top probability
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < settings.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < settings.top_k < vocab:
        kth = torch.topk(scaled, settings.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= settings.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def is_distribution(weights: torch.Tensor) -> torch.Tensor:
    """Per row of weights [..., V]: finite, >= 0 and a finite, positive sum (what a draw needs)."""
    total = weights.sum(dim=-1)
    return torch.isfinite(weights).all(dim=-1) & (weights >= 0).all(dim=-1) & (total > 0) & torch.isfinite(total)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token from unnormalized weights [V] and whether they were a distribution (finite, >= 0, sum > 0),
    both still on the device. Weights that are not are swapped for uniform ones before the draw, because
    multinomial's own check raises on the CPU and is a device-side assert on CUDA (which poisons every
    request); the caller reads the flag with the token in the copy it makes anyway."""
    valid = is_distribution(weights)
    safe = torch.where(valid, weights, torch.ones_like(weights))
    return torch.multinomial(safe, 1, generator=generator)[0], valid


def sample(
    logits: torch.Tensor, settings: list[SamplingSettings], generators: list[torch.Generator | None]
) -> list[int | SamplingError]:
    """One token per row of logits [N, V]; greedy rows in one argmax, sampled rows drawn together (each row's
    noise from its own generator). A row whose logits are not finite (or give no distribution) gets a
    SamplingError in its place, so only its request fails; one host copy for the whole batch."""
    tokens = logits.argmax(dim=-1)
    valid = torch.isfinite(logits.gather(-1, tokens[:, None])[:, 0])  # argmax finds a NaN or +inf if any
    rows = [row for row, setting in enumerate(settings) if not setting.greedy]
    if rows:
        index = to_device(rows, torch.int64, logits.device)
        drawn, ok = draw_rows(sampled_probs(logits[index], [settings[r] for r in rows]), [generators[r] for r in rows])
        tokens[index] = drawn
        valid[index] &= ok
    count = tokens.shape[0]
    host = to_host(torch.cat([tokens, valid.long()]))
    return [
        token if ok else SamplingError(f"row {row}: the logits give no distribution (inf or NaN)")
        for row, (token, ok) in enumerate(zip(host[:count], host[count:], strict=True))
    ]


def sampled_probs(logits: torch.Tensor, settings: list[SamplingSettings]) -> torch.Tensor:
    """target_probs of each row [N, V] under its own settings, in one pass over the rows instead of a pass per
    row: target_probs' steps, each on the rows that set that filter, with their values read from tensors. The
    same numbers as target_probs row by row, whatever the batch."""
    logits = logits.float()
    vocab = logits.shape[-1]
    temperature = to_device([s.temperature for s in settings], torch.float32, logits.device)[:, None]
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    scaled = _on_rows(scaled, settings, lambda s: s.min_p > 0.0, _min_p)
    scaled = _on_rows(scaled, settings, lambda s: 0 < s.top_k < vocab, _top_k)
    return _on_rows(torch.softmax(scaled, dim=-1), settings, lambda s: s.top_p < 1.0, _top_p)


def _on_rows(
    values: torch.Tensor,
    settings: list[SamplingSettings],
    wanted: Callable[[SamplingSettings], bool],
    apply: Callable[[torch.Tensor, list[SamplingSettings]], torch.Tensor],
) -> torch.Tensor:
    """`apply` on the rows whose settings want it (in place in `values`, a tensor of sampled_probs' own)."""
    rows = [row for row, s in enumerate(settings) if wanted(s)]
    if len(rows) == len(settings):
        return apply(values, settings)
    if rows:
        index = to_device(rows, torch.int64, values.device)
        values[index] = apply(values[index], [settings[row] for row in rows])
    return values


def _min_p(scaled: torch.Tensor, settings: list[SamplingSettings]) -> torch.Tensor:
    min_p = to_device([s.min_p for s in settings], torch.float32, scaled.device)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    return scaled.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def _top_k(scaled: torch.Tensor, settings: list[SamplingSettings]) -> torch.Tensor:
    """Each row keeps the values at least its k-th largest (ties kept, as target_probs)."""
    top_k = [s.top_k for s in settings]
    k = to_device(top_k, torch.int64, scaled.device)[:, None]
    kth = torch.topk(scaled, max(top_k), dim=-1).values.gather(-1, k - 1)
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_p(probs: torch.Tensor, settings: list[SamplingSettings]) -> torch.Tensor:
    top_p = to_device([s.top_p for s in settings], torch.float32, probs.device)[:, None]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of probabilities [N, V] by an exponential race: the argmax of p / E with E ~ Exp(1)
    is token i with probability p_i. Each row's noise comes from its own generator, so a seeded request does
    not depend on its batch. Also whether each row was a distribution (finite, >= 0, sum > 0); rows that are
    not draw from uniform weights, as `draw` does."""
    return race(probs, exponential_noise(generators, probs.shape[-1], probs.device))


def exponential_noise(generators: list[torch.Generator | None], vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [N, V], row i from generators[i]: one launch per generator (torch has no batched draw over
    many), and one for all the rows without one (None: the device's default generator)."""
    shared = [i for i, g in enumerate(generators) if g is None]
    noise = torch.empty(len(generators), vocab, device=device)
    if len(shared) == len(generators):
        return noise.exponential_()
    if shared:
        noise[to_device(shared, torch.int64, device)] = torch.empty(len(shared), vocab, device=device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return noise


def race(weights: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race of unnormalised weights [N, V] against noise [N, V] ~ Exp(1): argmax of
    weights / noise, which is what torch.multinomial draws (without its host checks). Also whether each row
    was a distribution; rows that are not race uniform weights instead."""
    valid = is_distribution(weights)
    safe = torch.where(valid[:, None], weights, torch.ones_like(weights))
    return (safe / noise).argmax(dim=-1), valid


def to_host(tokens: torch.Tensor) -> list[int]:
    """The sampled ids on the host. On GPUs the wait happens in CUDA event synchronize, which releases
    the GIL: the asyncio loop streams the previous step's tokens while this step runs (tolist() would hold
    the GIL for the whole step)."""
    if not tokens.is_cuda:
        return tokens.tolist()
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
