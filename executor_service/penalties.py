"""Repetition, presence and frequency penalties, as vLLM (and OpenAI, transformers) define them, applied to the
target's logits before temperature, min-p, top-k and top-p (sampling.py):

- `repetition_penalty` r: a token of the prompt or of the output has its logit divided by r if it is positive,
  multiplied by r if not;
- `frequency_penalty` f: minus f for every time the token occurs in the output;
- `presence_penalty` p: minus p if the token occurs in the output at all.

Verification scores a request's k drafts in one pass (k + 1 rows). Row j is penalised as if drafts 0..j-1 had
been emitted: its token is only emitted if they were. So every row is exactly the distribution the target would
sample from one token at a time, and rejection sampling stays lossless under the penalties. Greedy requests
take the argmax of the penalised rows.

Each request keeps its counts on the device (`TokenCounts`), brought up to date with the tokens emitted since
its last step: a step copies the few new ids, never the prompt again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from executor_service.sampling import SamplingSettings


class TokenCounts:
    """Which tokens the prompt holds, and how often each one occurs in the output so far, on the device."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device) -> None:
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(prompt_ids, dtype=torch.int64, device=device)] = True
        self.output = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.num_counted = 0  # output tokens counted in `output`

    def update(self, output_ids: list[int]) -> None:
        """Count the output tokens emitted since the last update (outputs only ever grow)."""
        new = output_ids[self.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.int64, device=self.output.device)
            self.output.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            self.num_counted = len(output_ids)


class History(Protocol):
    """What penalties read of a request (request.Request): its tokens, and where its counts are kept."""

    prompt_ids: list[int]
    output_ids: list[int]
    token_counts: TokenCounts | None


def counts_per_row(output: torch.Tensor, drafts: list[int]) -> torch.Tensor:
    """[k + 1, V] output counts of a request's verify rows: row j's add drafts 0..j-1 to the emitted tokens'."""
    rows = output.unsqueeze(0).repeat(len(drafts) + 1, 1)
    if drafts:
        pairs = [(row, draft) for i, draft in enumerate(drafts) for row in range(i + 1, len(drafts) + 1)]
        index = torch.tensor(pairs, dtype=torch.int64, device=output.device).t()
        rows.index_put_((index[0], index[1]), torch.ones_like(index[0], dtype=rows.dtype), accumulate=True)
    return rows


def penalise(
    logits: torch.Tensor,
    in_prompt: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised float32 logits [R, V] from the prompt's tokens [R, V] (bool), the output counts [R, V] and one
    of each penalty per row [R]. A logit that a tiny repetition penalty lifts past float32 stays the largest
    finite value, since inf would give no distribution (the model's own inf or NaN is caught on the raw
    logits: rejection_sampler.verify_batch)."""
    in_output = counts > 0
    logits = logits.float()
    repeated = torch.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
    logits = torch.where(in_prompt | in_output, repeated, logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * in_output
    return logits.clamp(max=torch.finfo(torch.float32).max)


def penalised_logits(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    histories: Sequence[History | None],
    drafts: Sequence[list[int]],
) -> torch.Tensor:
    """The step's logits [N, V] (each request's k + 1 rows in turn) with the rows of every request that sets
    a penalty penalised: a float32 copy, or `logits` itself when no request does. Requests whose drafts lie
    outside the vocabulary are left alone (verification fails them)."""
    vocab, device = logits.shape[-1], logits.device
    rows, prompts, counts, params = [], [], [], []
    start = 0
    for setting, history, request_drafts in zip(settings, histories, drafts, strict=True):
        num_rows = len(request_drafts) + 1
        in_vocab = not request_drafts or (min(request_drafts) >= 0 and max(request_drafts) < vocab)
        if setting.has_penalties and history is not None and in_vocab:
            if history.token_counts is None:
                history.token_counts = TokenCounts(history.prompt_ids, vocab, device)
            history.token_counts.update(history.output_ids)
            rows += range(start, start + num_rows)
            prompts.append(history.token_counts.in_prompt.expand(num_rows, vocab))
            counts.append(counts_per_row(history.token_counts.output, request_drafts))
            penalties = (setting.repetition_penalty, setting.presence_penalty, setting.frequency_penalty)
            params += [penalties] * num_rows
        start += num_rows
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    repetition, presence, frequency = torch.tensor(params, dtype=torch.float32, device=device).t()
    out = logits.to(torch.float32, copy=True)
    out[index] = penalise(out[index], torch.cat(prompts), torch.cat(counts), repetition, presence, frequency)
    return out
