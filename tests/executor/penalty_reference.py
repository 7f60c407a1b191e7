"""Penalties and min-p written out token by token from their definitions (vLLM's, OpenAI's), in float64, with
no code of executor_service: what the engine's batched, draft-aware penalties must reproduce."""

from __future__ import annotations

import torch
from greedy_reference import dense_logits

from executor_service.models.model import DecoderModel
from executor_service.sample.sampling import SamplingSettings


def reference_logits(
    row: torch.Tensor, prompt: list[int], output: list[int], settings: SamplingSettings
) -> torch.Tensor:
    """Penalised logits [V] (float64) of the position after prompt + output: the logit bias first (vLLM's order),
    then the penalties."""
    logits = row.double().clone()
    for token, bias in settings.logit_bias:
        logits[token] += bias
    for token in range(logits.shape[0]):
        count = output.count(token)
        if token in prompt or count:
            value = float(logits[token])
            rep = settings.repetition_penalty
            logits[token] = value / rep if value > 0 else value * rep
        logits[token] -= settings.frequency_penalty * count + settings.presence_penalty * (count > 0)
    return logits


def reference_probs(
    row: torch.Tensor, prompt: list[int], output: list[int], settings: SamplingSettings
) -> torch.Tensor:
    """The distribution a sampled request draws from: penalties, temperature, then min-p (no top-k / top-p)."""
    probs = torch.softmax(reference_logits(row, prompt, output, settings) / settings.temperature, dim=-1)
    probs = torch.where(probs < settings.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def greedy_penalised(model: DecoderModel, prompt: list[int], max_tokens: int, settings: SamplingSettings) -> list[int]:
    """Full-recompute greedy decoding: the argmax of the penalised logits at every step."""
    output: list[int] = []
    for _ in range(max_tokens):
        row = dense_logits(model, prompt + output)[-1]
        output.append(int(reference_logits(row, prompt, output, settings).argmax()))
    return output
