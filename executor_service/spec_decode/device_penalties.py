"""Penalties and logprobs inside the device step (spec_step.py), the same numbers as the host path's
(penalties.py, logprobs.py) with no host work per step.

Each penalised request owns a slot of a `PenaltyTable` for as long as it is live: which tokens its prompt holds
and how often each occurs in its output, [slots, V] on the device. The step reads its requests' slots, penalises
every verify row (row r as if the drafts on its path had been emitted, as penalties.counts_per_row does), and
adds the tokens it emits to the slots itself, so a step launched ahead of the read-back finds them counted. The
host uploads only the tokens emitted outside the device step (a prefill, a host-path step), when a request comes
back to it. Requests without penalties read the scratch slot (-1: the last row, all zero) with penalties that
change nothing.

Penalising a row touches every logit once (the emitted tokens' counts, broadcast); only the few entries of the
drafts' own tokens differ between rows, and those are recomputed from their exact counts and written over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.engine.request import Request
from executor_service.models.attention_step import to_device
from executor_service.sample.logprobs import MAX_LOGPROBS, TokenLogprob
from executor_service.sample.penalties import penalise_values
from executor_service.sample.sampling import MAX_LOGIT_BIAS


@dataclass
class Slot:
    index: int
    counted: int  # output tokens of the request already in the slot


class PenaltyTable:
    """Per-slot prompt tokens [slots + 1, V] (bool), output counts [slots + 1, V] (int32) and logit bias (token ids
    and biases [slots + 1, MAX_LOGIT_BIAS], padded with token 0 and bias 0); the last row is the scratch slot.
    Allocated at the first penalised request, or before graphs capture the step (they read it)."""

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        self.slots, self.vocab, self.device = slots, vocab, device
        self.in_prompt: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.assigned: dict[str, Slot] = {}

    def allocate(self) -> None:
        if self.output is None:
            rows, device = self.slots + 1, self.device
            self.in_prompt = torch.zeros(rows, self.vocab, dtype=torch.bool, device=device)
            self.output = torch.zeros(rows, self.vocab, dtype=torch.int32, device=device)
            self.bias_ids = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)
            self.bias_values = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)

    def fits(self, requests: list[Request]) -> bool:
        """Whether every penalised request of the batch has a slot or can get one."""
        new = sum(r.settings.has_penalties and r.request_id not in self.assigned for r in requests)
        return len(self.assigned) + new <= self.slots

    def slots_of(self, requests: list[Request]) -> list[int]:
        """Each request's slot (-1: none), assigning and filling new ones and counting the tokens emitted since
        a request last left the device step. Host work only for those."""
        found = []
        for request in requests:
            if not request.settings.has_penalties:
                found.append(-1)
                continue
            slot = self.assigned.get(request.request_id)
            if slot is None:
                slot = self._assign(request)
            if slot.counted < len(request.output_ids):
                assert self.output is not None
                ids = to_device(request.output_ids[slot.counted :], torch.int64, self.device)
                self.output[slot.index].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
                slot.counted = len(request.output_ids)
            found.append(slot.index)
        return found

    def _assign(self, request: Request) -> Slot:
        self.allocate()
        assert self.output is not None and self.in_prompt is not None
        used = {s.index for s in self.assigned.values()}
        index = next(i for i in range(self.slots) if i not in used)
        self.output[index].zero_()
        self.in_prompt[index].zero_()
        self.in_prompt[index].index_fill_(0, to_device(request.prompt_ids, torch.int64, self.device), True)
        assert self.bias_ids is not None and self.bias_values is not None
        self.bias_ids[index].zero_()
        self.bias_values[index].zero_()
        bias = request.settings.logit_bias
        if bias:
            self.bias_ids[index, : len(bias)].copy_(to_device([t for t, _ in bias], torch.int64, self.device))
            self.bias_values[index, : len(bias)].copy_(to_device([b for _, b in bias], torch.float32, self.device))
        slot = self.assigned[request.request_id] = Slot(index, 0)
        return slot

    def bias_rows(self, slot: torch.Tensor) -> torch.Tensor:
        """[B, V] float32: each request's logit bias from its slot [B] (-1: the zero scratch slot), 0 elsewhere (the
        padding adds 0 to token 0). Built once a step; the verifier and the drafter's picks both add it."""
        assert self.bias_ids is not None and self.bias_values is not None
        bias = torch.zeros(slot.shape[0], self.vocab, dtype=torch.float32, device=slot.device)
        return bias.scatter_add_(1, self.bias_ids[slot], self.bias_values[slot])

    def booked(self, request: Request) -> None:
        """A device step's tokens are in the request's output: the step counted them in its slot too."""
        slot = self.assigned.get(request.request_id)
        if slot is not None:
            slot.counted = len(request.output_ids)

    def release(self, request_id: str) -> None:
        """The request finished; its slot is filled afresh when given out again (after any step in flight)."""
        self.assigned.pop(request_id, None)


def penalty_params(requests: list[Request]) -> list[tuple[float, float, float]]:
    """(repetition, presence, frequency) per request: (1, 0, 0) changes nothing."""
    return [(s.repetition_penalty, s.presence_penalty, s.frequency_penalty) for s in (r.settings for r in requests)]


def penalty_inputs(
    slots: list[int], params: list[tuple[float, float, float]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's penalty table slots [B] (-1: none) and (repetition, presence, frequency) [B, 3] on the device,
    without waiting for it."""
    penalty = to_device(params, torch.float32, device).view(len(slots), 3)
    return to_device(slots, torch.int64, device), penalty


def penalise_rows(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    on_path: torch.Tensor,
    table: PenaltyTable,
    slot: torch.Tensor,
    params: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Penalised float32 logits [B * R, V] of B requests' R verify rows, each request's logit bias (`bias` [B, V]:
    PenaltyTable.bias_rows) added first. tokens [B, N]: the drafts; on_path [B or 1, R, N]: whether draft j is on
    row r's path (counted as emitted there); slot [B]; params [B, 3]."""
    assert table.output is not None and table.in_prompt is not None
    count, num = tokens.shape
    vocab = logits.shape[-1]
    rows = logits.shape[0] // count
    repetition, presence, frequency = (params[:, i, None, None] for i in range(3))
    in_prompt, output = table.in_prompt[slot], table.output[slot]  # [B, V]; slot -1: the scratch row
    by_row = logits.view(count, rows, vocab).float() + bias[:, None]
    out = penalise_values(by_row, in_prompt[:, None], output[:, None], repetition, presence, frequency)
    # A draft's token at row r: its emitted count plus the drafts on r's path with the same token.
    same = (tokens[:, :, None] == tokens[:, None, :]).float()
    extra = torch.matmul(on_path.float(), same).to(torch.int32)  # [B, R, N], exact small integers
    at = tokens[:, None, :].expand(count, rows, num)
    counts = output.gather(1, tokens)[:, None, :] + extra
    fixed = penalise_values(
        by_row.gather(2, at), in_prompt.gather(1, tokens)[:, None, :], counts, repetition, presence, frequency
    )
    return out.scatter_(2, at, fixed).view(count * rows, vocab)  # equal tokens of a row get equal values


def count_emitted(
    table: PenaltyTable, slot: torch.Tensor, emitted: torch.Tensor, accepted: torch.Tensor, index: torch.Tensor
) -> None:
    """Add each request's emitted tokens (the first accepted + 1 of emitted [B, W]) to its slot's counts;
    index: 0, 1, ..., W - 1."""
    assert table.output is not None
    row = torch.where(slot >= 0, slot, table.slots)
    keep = (index[None, :] <= accepted[:, None]) & (slot[:, None] >= 0)
    flat = (row[:, None] * table.vocab + emitted).reshape(-1)
    table.output.view(-1).index_add_(0, flat, keep.reshape(-1).to(torch.int32))


def logprob_width(vocab: int) -> int:
    return min(MAX_LOGPROBS, vocab)


def emitted_logprobs(logits: torch.Tensor, rows: torch.Tensor, emitted: torch.Tensor) -> torch.Tensor:
    """The raw log-softmax (logprobs.py: before penalties and sampling) at each emitted token's row: [B, W * (1 +
    2 * top)] int64 of the emitted tokens' logprobs, the top values (float32 bits) and the top ids, per token.
    rows [B, W]: flat logits rows of emitted [B, W]."""
    count = emitted.shape[0]
    logprobs = torch.log_softmax(logits[rows.reshape(-1)].float(), dim=-1)
    chosen = logprobs.gather(1, emitted.reshape(-1, 1))
    values, ids = logprobs.topk(logprob_width(logits.shape[-1]), dim=-1)
    bits = torch.cat([chosen, values], dim=1).view(torch.int32).long()
    return torch.cat([bits.view(count, -1), ids.view(count, -1)], dim=1)


def unpack_logprobs(host: torch.Tensor, tokens: list[int], top: int, n: int) -> list[TokenLogprob]:
    """TokenLogprob of each token from one request's emitted_logprobs (host int64 [W * (1 + 2 * top)])."""
    width = host.shape[0] // (1 + 2 * top)
    floats = host[: width * (1 + top)].to(torch.int32).view(torch.float32).view(width, 1 + top).tolist()
    ids = host[width * (1 + top) :].view(width, top).tolist()
    keep = min(n, top)
    return [
        TokenLogprob(token, floats[i][0], tuple(zip(ids[i][:keep], floats[i][1 : 1 + keep], strict=True)))
        for i, token in enumerate(tokens)
    ]
