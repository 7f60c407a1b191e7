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
