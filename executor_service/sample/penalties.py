"""Repetition, presence and frequency penalties, as vLLM (and OpenAI, transformers) define them, applied to the
target's logits before temperature, min-p, top-k and top-p (sampling.py), after a request's logit bias (added to
its tokens' logits first, as vLLM orders them):

- `repetition_penalty` r: a token of the prompt or of the output has its logit divided by r if it is positive,
  multiplied by r if not;
- `frequency_penalty` f: minus f for every time the token occurs in the output;
- `presence_penalty` p: minus p if the token occurs in the output at all.

Verification scores a request's k drafts in one pass (k + 1 rows). Row j is penalised as if drafts 0..j-1 had
been emitted: its token is only emitted if they were. A tree's row is penalised as if the drafts on its path
(its ancestors and itself, the root aside) had been emitted. So every row is exactly the distribution the target would
sample from one token at a time, and rejection sampling stays lossless under the penalties. Greedy requests
take the argmax of the penalised rows.

Each request keeps its counts on the device (`TokenCounts`), brought up to date with the tokens emitted since
its last step: a step copies the few new ids, never the prompt again. Host lists reach the device through
`to_device` (pinned, asynchronous on CUDA), so none of this waits for the step in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from executor_service.models.attention_step import to_device
from executor_service.sample.sampling import SamplingSettings


class TokenCounts:
    """Which tokens the prompt holds, and how often each one occurs in the output so far, on the device."""

    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device) -> None:
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        # index_fill_ takes its value as a kernel argument: `in_prompt[ids] = True` copies a host scalar, which
        # waits for the device
        self.in_prompt.index_fill_(0, to_device(prompt_ids, torch.int64, device), True)
        self.output = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.num_counted = 0  # output tokens counted in `output`

    def update(self, output_ids: list[int]) -> None:
        """Count the output tokens emitted since the last update (outputs only ever grow)."""
        new = output_ids[self.num_counted :]
        if new:
            ids = to_device(new, torch.int64, self.output.device)
            self.output.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
            self.num_counted = len(output_ids)


class History(Protocol):
    """What penalties read of a request (request.Request): its tokens, and where its counts are kept."""

    prompt_ids: list[int]
    output_ids: list[int]
    token_counts: TokenCounts | None


def current_counts(history: History, vocab_size: int, device: torch.device) -> TokenCounts:
    """The request's counts, made at its first penalised step and brought up to its output now: what verification
    (`penalised_logits`) and the host path's penalised drafting (spec_decode/draft_penalties.py) read."""
    if history.token_counts is None:
        history.token_counts = TokenCounts(history.prompt_ids, vocab_size, device)
    history.token_counts.update(history.output_ids)
    return history.token_counts


def path_drafts(parents: list[int]) -> list[list[int]]:
    """Per verify row (0: the root, j + 1: draft j), the drafts on its path: its ancestors' and its own."""
    paths: list[list[int]] = [[]]
    for j, parent in enumerate(parents):
        paths.append([*paths[parent + 1], j])
    return paths


def counts_per_row(output: torch.Tensor, drafts: list[int], parents: list[int] | None = None) -> torch.Tensor:
    """[k + 1, V] output counts of a request's verify rows: row j's add drafts 0..j-1 to the emitted tokens' (a
    chain), or the drafts on its path (a tree: `parents`, -1 the root)."""
    rows = output.unsqueeze(0).repeat(len(drafts) + 1, 1)
    if drafts:
        if parents is None:
            pairs = [(row, draft) for i, draft in enumerate(drafts) for row in range(i + 1, len(drafts) + 1)]
        else:
            pairs = [(row, drafts[j]) for row, path in enumerate(path_drafts(parents)) for j in path]
        flat = to_device([row * output.shape[0] + draft for row, draft in pairs], torch.int64, output.device)
        # index_add_ rather than index_put_(accumulate=True): torch versions that check its indices on the
        # host (a device sync) exist, and verification must not wait for the device (one host copy a step)
        rows.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=rows.dtype))
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
    logits: host_verify.verify_on_host)."""
    return penalise_values(logits, in_prompt, counts, repetition[:, None], presence[:, None], frequency[:, None])


def penalise_values(
    logits: torch.Tensor,
    in_prompt: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """`penalise` elementwise, every argument broadcast against the others: the one formula of the host path and
    the device step (device_penalties.py), so that both give the same float32 values."""
    in_output = counts > 0
    logits = logits.float()
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(in_prompt | in_output, repeated, logits)
    logits = logits - frequency * counts - presence * in_output
    return logits.clamp(max=torch.finfo(torch.float32).max)


def penalised_logits(
    logits: torch.Tensor,
    settings: Sequence[SamplingSettings],
    histories: Sequence[History | None],
    drafts: Sequence[list[int]],
    parents: Sequence[list[int] | None] | None = None,
) -> torch.Tensor:
    """The step's logits [N, V] (each request's k + 1 rows in turn) with the rows of every request that sets
    a penalty penalised: a float32 copy, or `logits` itself when no request does. `parents`: a request's tree
    (None, or a None entry: a chain). Requests whose drafts lie outside the vocabulary are left alone
    (verification fails them)."""
    vocab, device = logits.shape[-1], logits.device
    found: list[Penalised] = []
    start = 0
    trees = parents if parents is not None else [None] * len(drafts)
    for setting, history, request_drafts, tree in zip(settings, histories, drafts, trees, strict=True):
        num_rows = len(request_drafts) + 1
        in_vocab = not request_drafts or (min(request_drafts) >= 0 and max(request_drafts) < vocab)
        if setting.has_penalties and history is not None and in_vocab:
            found.append(Penalised(start, setting, current_counts(history, vocab, device), request_drafts, tree))
        start += num_rows
    if not found:
        return logits
    out = logits.to(torch.float32, copy=True)
    group: list[Penalised] = []
    for entry in found:  # in groups of about ROWS_PER_PASS rows: the [rows, V] counts stay small
        group.append(entry)
        if sum(len(e.drafts) + 1 for e in group) >= ROWS_PER_PASS or entry is found[-1]:
            _penalise_group(out, group)
            group = []
    return out


ROWS_PER_PASS = 128  # rows penalised at once: [128, V] counts, masks and temporaries (64 MiB each at V = 128k)


@dataclass(frozen=True)
class Penalised:
    """One request's rows to penalise: the first row, its settings, counts, drafts (k + 1 rows) and their
    parents (None: a chain)."""

    start: int
    settings: SamplingSettings
    counts: TokenCounts
    drafts: list[int]
    parents: list[int] | None = None


def _penalise_group(out: torch.Tensor, group: list[Penalised]) -> None:
    """Penalise the rows of these requests in `out` (float32) in place."""
    vocab, device = out.shape[-1], out.device
    rows = [row for e in group for row in range(e.start, e.start + len(e.drafts) + 1)]
    params = [
        (e.settings.repetition_penalty, e.settings.presence_penalty, e.settings.frequency_penalty)
        for e in group
        for _ in range(len(e.drafts) + 1)
    ]
    in_prompt = torch.cat([e.counts.in_prompt.expand(len(e.drafts) + 1, vocab) for e in group])
    counts = torch.cat([_row_counts(e) for e in group])
    index = to_device(rows, torch.int64, device)
    repetition, presence, frequency = to_device(params, torch.float32, device).t()
    out[index] = penalise(_biased(out[index], group), in_prompt, counts, repetition, presence, frequency)


def _biased(rows: torch.Tensor, group: list[Penalised]) -> torch.Tensor:
    """The group's rows [R, V] with each request's logit bias added to every one of its rows."""
    if not any(entry.settings.logit_bias for entry in group):
        return rows
    bias = dense_bias([entry.settings for entry in group], rows.shape[-1], rows.device)
    per_request = to_device([len(entry.drafts) + 1 for entry in group], torch.int64, rows.device)
    return rows.float() + bias.repeat_interleave(per_request, dim=0, output_size=rows.shape[0])


def dense_bias(settings: Sequence[SamplingSettings], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32: each request's logit bias at its tokens, 0 elsewhere (one copy to the device): the host
    path's verify rows (`_biased`) and its penalised drafting (draft_penalties.py) add it."""
    positions = [row * vocab + token for row, s in enumerate(settings) for token, _ in s.logit_bias]
    values = [bias for s in settings for _, bias in s.logit_bias]
    bias = torch.zeros(len(settings) * vocab, dtype=torch.float32, device=device)
    if positions:
        bias.index_put_((to_device(positions, torch.int64, device),), to_device(values, torch.float32, device))
    return bias.view(len(settings), vocab)


def _row_counts(entry: Penalised) -> torch.Tensor:
    """counts_per_row of a chain, or of a tree (a chain's call is kept as it was: tests replace it)."""
    if entry.parents is None:
        return counts_per_row(entry.counts.output, entry.drafts)
    return counts_per_row(entry.counts.output, entry.drafts, entry.parents)
