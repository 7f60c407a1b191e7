"""Log probabilities of the emitted tokens, and the top-n alternatives, from the target's distribution.

They are the log-softmax of the target's raw logits, the model's own distribution before penalties,
temperature, min-p, top-k and top-p: what vLLM returns by default (`logprobs_mode` "raw_logprobs") and what
OpenAI-style callers compare across settings. Verification reads them from the target's verify rows: a draft
accepted at row j gets row j's log probability, the target's, never the drafter's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_service.models.attention_step import to_device
from executor_service.sample.sampling import SamplingSettings, to_host

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log probability and the top alternatives, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def batch_logprobs(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    drafts: Sequence[list[int]],
    emitted: Sequence[list[int] | BaseException],
) -> list[list[TokenLogprob] | None]:
    """Per request of a verified step (verify_on_host's order: k + 1 rows each), the TokenLogprob of every
    emitted token, or None for requests that ask for none or failed. Emitted token i comes from row i of its
    request. One log-softmax over the rows asked for, one host copy."""
    found: list[list[TokenLogprob] | None] = [None] * len(settings)
    rows, tokens, asking = [], [], []
    start = 0
    for index, (setting, request_drafts, tokens_out) in enumerate(zip(settings, drafts, emitted, strict=True)):
        if setting.logprobs is not None and not isinstance(tokens_out, BaseException):
            rows += range(start, start + len(tokens_out))
            tokens += tokens_out
            asking.append((index, len(tokens_out), setting.logprobs))
        start += len(request_drafts) + 1
    if not rows:
        return found
    device = logits.device
    logprobs = torch.log_softmax(logits[to_device(rows, torch.int64, device)].float(), dim=-1)
    chosen = logprobs.gather(1, to_device(tokens, torch.int64, device)[:, None])[:, 0]
    width = min(max(n for _, _, n in asking), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(width, dim=-1) if width else (logprobs[:, :0], logprobs[:, :0])
    host = to_host(torch.cat([chosen.double(), top_values.double().reshape(-1), top_ids.double().reshape(-1)]))
    count = len(rows)
    values, ids = host[count : count + count * width], host[count + count * width :]
    row = 0
    for index, num_tokens, n in asking:
        per_token = []
        for i in range(row, row + num_tokens):
            top = tuple((int(ids[i * width + j]), values[i * width + j]) for j in range(min(n, width)))
            per_token.append(TokenLogprob(tokens[i], host[i], top))
        found[index] = per_token
        row += num_tokens
    return found
