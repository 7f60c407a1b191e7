"""Penalties and logprobs in the device step (device_penalties.py) against the host path's (penalties.py,
logprobs.py): the penalised rows bit for bit (chains and trees, every verify row counting the drafts on its
path), the distributions sampled rows draw from, the raw logprobs of emitted tokens, and the table's counts
after a step (what it emitted, the slot of a request without penalties left alone)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from executor_service.runner.step_constants import StepConstants
from executor_service.sample.logprobs import batch_logprobs
from executor_service.sample.penalties import TokenCounts, penalised_logits
from executor_service.sample.sampling import SamplingSettings, target_logprobs
from executor_service.spec_decode.device_penalties import (
    PenaltyTable,
    count_emitted,
    emitted_logprobs,
    penalty_params,
    unpack_logprobs,
)
from executor_service.spec_decode.host_verify import DraftTree
from executor_service.spec_decode.verifier import DraftLayout, StepPenalties, tree_layout

VOCAB = 11
TREE = [-1, -1, 0, 0, 1, 2, 5]  # drafts 0, 1 under the root; 2, 3 under 0; 4 under 1; 5 under 2; 6 under 5
SETTINGS = [
    SamplingSettings(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.7),
    SamplingSettings(),  # greedy, no penalty: its rows are left as they are
    SamplingSettings(repetition_penalty=0.6, frequency_penalty=-0.4, logit_bias=((2, 1.5), (7, -3.0))),  # greedy
    SamplingSettings(temperature=1.1, top_k=4, presence_penalty=-0.3, logprobs=3),
]


@dataclass(eq=False)
class FakeRequest:
    """What the table and the host's penalties read of a request."""

    request_id: str
    prompt_ids: list[int]
    settings: SamplingSettings
    output_ids: list[int] = field(default_factory=list)
    token_counts: TokenCounts | None = None


def batch(seed: int, parents: list[int]) -> tuple[list[FakeRequest], torch.Tensor, torch.Tensor]:
    """Requests with short histories over few ids (repeats), their drafts [B, N] (equal tokens on a path too)
    and logits [B * (N + 1), V]."""
    rng = random.Random(seed)
    requests = []
    for i, settings in enumerate(SETTINGS):
        output = [rng.randrange(6) for _ in range(rng.randint(0, 5))]
        requests.append(FakeRequest(f"r{i}", [rng.randrange(5) for _ in range(4)], settings, output))
    drafts = torch.tensor([[rng.randrange(5) for _ in parents] for _ in requests])
    logits = torch.randn(len(requests) * (len(parents) + 1), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    return requests, drafts, logits


def layout_of(drafts: torch.Tensor, parents: list[int], chain: bool) -> DraftLayout:
    parents_t = torch.tensor([parents] * drafts.shape[0])
    depth = max(DraftTree(drafts[0].tolist(), parents).depths())
    node_depth, ancestors = tree_layout(parents_t, depth)
    return DraftLayout(drafts, parents_t, node_depth, ancestors, depth, chain=chain)


def device_penalties(requests: list[FakeRequest]) -> StepPenalties:
    table = PenaltyTable(8, VOCAB, torch.device("cpu"))
    slot = torch.tensor(table.slots_of(requests))  # type: ignore[arg-type]
    params = torch.tensor(penalty_params(requests))  # type: ignore[arg-type]
    return StepPenalties(table, slot, params, table.bias_rows(slot))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_penalised_rows_equal_the_host_path(shape: str, seed: int) -> None:
    """Every row bit for bit, then the distribution each sampled row draws from."""
    parents = [-1, 0, 1, 2, 3] if shape == "chain" else TREE
    requests, drafts, logits = batch(seed, parents)
    penalties = device_penalties(requests)
    device = penalties.apply(logits, layout_of(drafts, parents, shape == "chain"), StepConstants(logits.device))
    draft_lists = drafts.tolist()
    trees = None if shape == "chain" else [parents] * len(requests)
    host = penalised_logits(logits, [r.settings for r in requests], requests, draft_lists, trees)  # type: ignore[arg-type]
    assert torch.equal(device, host.float())
    rows = len(parents) + 1
    params = torch.tensor([[s.temperature, s.top_k, s.top_p, s.min_p] for s in SETTINGS]).repeat_interleave(rows, 0)
    assert torch.equal(target_logprobs(device, params, True), target_logprobs(host, params, True))
    assert not torch.equal(device[rows : 2 * rows], device[:rows])  # the penalties bite


def test_a_tree_row_counts_its_path_alone() -> None:
    """Row r of a tree is penalised as if exactly its path's drafts had been emitted (penalties written out)."""
    request = FakeRequest("r", [9], SamplingSettings(frequency_penalty=1.0))
    drafts = torch.tensor([[3, 4, 3, 5, 4, 3, 3]])
    logits = torch.zeros(len(TREE) + 1, VOCAB)
    out = device_penalties([request]).apply(logits, layout_of(drafts, TREE, False), StepConstants(logits.device))
    paths = {0: [], 1: [3], 2: [4], 3: [3, 3], 4: [3, 5], 5: [4, 4], 6: [3, 3, 3], 7: [3, 3, 3, 3]}
    for row, path in paths.items():
        expected = torch.zeros(VOCAB)
        for token in path:
            expected[token] -= 1.0
        assert torch.equal(out[row], expected), row


def test_the_step_counts_what_it_emitted() -> None:
    """count_emitted adds the first accepted + 1 tokens to a penalised request's slot; the scratch slot of
    a request without penalties stays zero."""
    requests = [
        FakeRequest("a", [1], SamplingSettings(presence_penalty=1.0), [2, 2]),
        FakeRequest("b", [1], SamplingSettings()),
    ]
    penalties = device_penalties(requests)  # type: ignore[arg-type]
    table = penalties.table
    emitted = torch.tensor([[5, 5, 6, 7], [3, 4, 5, 6]])
    count_emitted(table, penalties.slot, emitted, torch.tensor([2, 3]), torch.arange(4))
    assert table.output is not None and table.in_prompt is not None
    slot = penalties.slot[0].item()
    expected = torch.zeros(VOCAB, dtype=torch.int32)
    expected[2], expected[5], expected[6] = 2, 2, 1
    assert torch.equal(table.output[slot], expected)
    assert table.in_prompt[slot].nonzero().flatten().tolist() == [1]
    assert not table.output[-1].any() and not table.in_prompt[-1].any()
    requests[0].output_ids += [5, 5, 6]
    table.booked(requests[0])  # type: ignore[arg-type]
    requests[0].output_ids.append(9)  # emitted by the host path: uploaded at its next device step
    table.slots_of(requests)  # type: ignore[arg-type]
    assert table.output[slot, 9] == 1 and table.output[slot, 5] == 2
    table.release("a")
    assert not table.assigned


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_logprobs_of_the_emitted_tokens_equal_the_host_path(shape: str) -> None:
    """The raw log-softmax at each emitted token's row, and the top n, as batch_logprobs reads them (from the
    rows along the accepted path)."""
    parents = [-1, 0, 1, 2] if shape == "chain" else TREE
    requests, _, logits = batch(3, parents)
    rows = len(parents) + 1
    rng = random.Random(4)
    path_rows = torch.tensor([[0, *sorted(rng.sample(range(1, rows), 3))] for _ in requests])
    emitted = torch.tensor([[rng.randrange(VOCAB) for _ in range(4)] for _ in requests])
    flat = torch.arange(len(requests))[:, None] * rows + path_rows
    packed = emitted_logprobs(logits, flat, emitted)
    top = min(20, VOCAB)
    settings = [SamplingSettings(logprobs=n) for n in (0, 2, 5, 11)]
    host = batch_logprobs(logits[flat.reshape(-1)], settings, [[0] * 3] * len(requests), emitted.tolist())
    for index, setting in enumerate(settings):
        found = unpack_logprobs(packed[index], emitted[index].tolist(), top, setting.logprobs or 0)
        assert found == host[index]
