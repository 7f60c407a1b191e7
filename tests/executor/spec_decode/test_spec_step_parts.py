"""The device-resident step's parts on hand-made tensors: the verifier's greedy rule on a chain takes the argmax of
each row and stops at the first mismatch (a later match does not count); roll back keeps accepted + 1 rows."""

from __future__ import annotations

import torch

from executor_service.spec_decode.spec_step import VerifiedStep
from executor_service.spec_decode.verifier import DraftLayout, verify


def chain_verdict(logits: torch.Tensor, drafts: torch.Tensor):  # type: ignore[no-untyped-def]
    count, k = drafts.shape
    layout = DraftLayout(drafts, (torch.arange(k) - 1).expand(count, -1), None, None, k, chain=True)
    return verify(logits, layout, None, torch.zeros(count, dtype=torch.int64))


def test_verify_is_the_argmax_of_each_row_per_request() -> None:
    logits = torch.full((6, 5), -1.0)
    for row, token in enumerate([4, 0, 2, 3, 3, 1]):
        logits[row, token] = 1.0
    assert chain_verdict(logits, torch.zeros(2, 2, dtype=torch.int64)).emitted.tolist() == [[4, 0, 2], [3, 3, 1]]


def test_accept_stops_at_the_first_mismatch() -> None:
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3], [5, 6, 0]])
    logits = torch.nn.functional.one_hot(target, 10).float().view(-1, 10)
    assert chain_verdict(logits, drafts).accepted.tolist() == [3, 1, 0, 2]


def test_roll_back_keeps_the_accepted_drafts_and_the_token_after_them() -> None:
    step = VerifiedStep(target_ids=[[1, 2, 3, 4], [5, 6, 7, 8]], accepted=[3, 0], next_drafts=[[], []])
    assert [step.kept_rows(i) for i in range(2)] == [4, 1]
    assert [step.emitted(i) for i in range(2)] == [[1, 2, 3, 4], [5]]
