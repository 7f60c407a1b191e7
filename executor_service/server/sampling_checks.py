"""Checks of the sampling fields beyond temperature / top-p / top-k: min-p, the penalties, logprobs.

The bounds are vLLM's (SamplingParams._verify_args), so callers moving from vLLM get the same answers; each
comparison is written so that NaN fails it.
"""

from __future__ import annotations

import math

from executor_service.sample.logprobs import MAX_LOGPROBS
from specdec.v1 import executor_pb2
from specdec_runtime.errors import FieldViolation

PENALTY_BOUND = 2.0  # presence and frequency penalties: [-2, 2], as OpenAI and vLLM
LOGIT_BIAS_BOUND = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it


def sampling_violations(params: executor_pb2.SamplingParams) -> list[FieldViolation]:
    """Every bad value among min_p, the penalties and logprobs (unset fields are fine)."""
    found = []
    if not 0.0 <= params.min_p <= 1.0:
        found.append(FieldViolation("sampling.min_p", f"must be in [0, 1] (0: off), got {params.min_p}"))
    if params.HasField("repetition_penalty") and not 0.0 < params.repetition_penalty < math.inf:
        found.append(
            FieldViolation(
                "sampling.repetition_penalty",
                f"must be a finite number > 0 (1: none), got {params.repetition_penalty}",
            )
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -PENALTY_BOUND <= value <= PENALTY_BOUND:
            found.append(
                FieldViolation(
                    f"sampling.{name}", f"must be in [-{PENALTY_BOUND}, {PENALTY_BOUND}] (0: none), got {value}"
                )
            )
    if params.HasField("logprobs") and not 0 <= params.logprobs <= MAX_LOGPROBS:
        found.append(
            FieldViolation(
                "sampling.logprobs",
                f"must be in [0, {MAX_LOGPROBS}]: the top alternatives per token (0: the token's own only), "
                f"got {params.logprobs}",
            )
        )
    return found


def logit_bias_violations(params: executor_pb2.SamplingParams, vocab_size: int) -> list[FieldViolation]:
    """Each logit_bias entry's token in the vocabulary, once, its bias finite within +-LOGIT_BIAS_BOUND (its count
    is bounded before: prompt_intake.oversized)."""
    found, seen = [], set()
    for index, entry in enumerate(params.logit_bias):
        name = f"sampling.logit_bias[{index}]"
        if not 0 <= entry.token_id < vocab_size:
            found.append(
                FieldViolation(f"{name}.token_id", f"{entry.token_id} is outside the vocabulary of {vocab_size}")
            )
        elif entry.token_id in seen:
            found.append(FieldViolation(f"{name}.token_id", f"token {entry.token_id} is biased twice"))
        seen.add(entry.token_id)
        if not -LOGIT_BIAS_BOUND <= entry.bias <= LOGIT_BIAS_BOUND:
            found.append(
                FieldViolation(
                    f"{name}.bias", f"must be in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}], got {entry.bias}"
                )
            )
        if len(found) >= 8:  # enough to act on; the message stays short
            break
    return found
