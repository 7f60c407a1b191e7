"""The one verifier (verifier.py): the greedy rule against the host's walk, the sampled rule's output distribution
against the target's (total variation, with negative controls that must fail the same bound), and counter-based
draws that do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from executor_service import verifier
from executor_service.device_sampling import SamplingTensors, sampling_logprobs
from executor_service.sampling import SamplingSettings, target_probs
from executor_service.tree_verification import DraftTree, verify_greedy_tree
from executor_service.verifier import DraftLayout, tree_layout, verify

VOCAB = 6
CHAIN = [-1, 0, 1]  # three drafts in a chain
TREE = [-1, -1, -1, 0, 0, 3]  # the root's children 0, 1, 2 (2 repeats 0's token below); 3, 4 under 0; 5 under 3
TREE_TOKENS = [1, 2, 1, 3, 0, 4]


def layout_of(tokens: list[list[int]], parents: list[int], chain: bool = False) -> DraftLayout:
    tokens_t = torch.tensor(tokens)
    parents_t = torch.tensor([parents] * len(tokens))
    depth = max(DraftTree(tokens[0], parents).depths())
    node_depth, ancestors = tree_layout(parents_t, depth)
    return DraftLayout(tokens_t, parents_t, node_depth, ancestors, depth, chain=chain)


def test_greedy_rule_walks_as_the_host() -> None:
    torch.manual_seed(0)
    for parents in (CHAIN, TREE):
        for _ in range(50):
            rows = len(parents) + 1
            logits = torch.randn(rows, VOCAB)
            tokens = torch.randint(0, VOCAB, (len(parents),))
            tokens[0] = logits[0].argmax()  # so that some paths get long
            layout = layout_of([tokens.tolist()], parents, chain=parents is CHAIN)
            verdict = verify(logits, layout, None, torch.zeros(1, dtype=torch.int64))
            host = verify_greedy_tree(DraftTree(tokens.tolist(), parents), logits.argmax(-1).tolist())
            assert verdict.accepted.item() == len(host.path)
            assert verdict.emitted[0, : len(host.emitted)].tolist() == host.emitted


def sampled_first_tokens(parents: list[int], tokens: list[int], count: int, params: SamplingSettings) -> torch.Tensor:
    """The first emitted token of `count` requests with the same rows and different seeds."""
    torch.manual_seed(1)
    rows = len(parents) + 1
    logits = (torch.randn(rows, VOCAB) * 1.5).repeat(count, 1)
    layout = layout_of([tokens] * count, parents, chain=parents is CHAIN)
    sampling = SamplingTensors.build([params] * count, list(range(count)), torch.device("cpu"))
    sort = params.top_k > 0 or params.top_p < 1.0
    verdict = verify(logits, layout, sampling, torch.full((count,), 7), sort=sort)
    return verdict.emitted[:, 0], logits[:rows]


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    found = torch.bincount(samples, minlength=probs.shape[0]).double() / samples.shape[0]
    return 0.5 * (found - probs.double()).abs().sum().item()


SETTINGS = [
    SamplingSettings(temperature=1.0),
    SamplingSettings(temperature=0.7, top_k=3),
    SamplingSettings(temperature=1.3, top_p=0.8, min_p=0.05),
]
COUNT = 20_000
BOUND = 0.025  # ~5 standard errors of a 6-way TV at 20k draws


@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "topk", "topp-minp"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampled_rule_emits_the_target_distribution(shape: str, params: SamplingSettings) -> None:
    parents, tokens = (CHAIN, [2, 3, 1]) if shape == "chain" else (TREE, TREE_TOKENS)
    first, rows = sampled_first_tokens(parents, tokens, COUNT, params)
    assert total_variation(first, target_probs(rows[0], params)) < BOUND


def test_the_bound_catches_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: drawing the final token from p without removing the rejected children."""

    def without_removal(logprobs, layout, last, seed, step_key, constants):  # type: ignore[no-untyped-def]
        present = torch.zeros_like(layout.tokens, dtype=torch.bool)
        return original(
            logprobs, DraftLayout(**{**layout.__dict__, "present": present}), last, seed, step_key, constants
        )

    original = verifier._final_draws
    monkeypatch.setattr(verifier, "_final_draws", without_removal)
    first, rows = sampled_first_tokens(TREE, TREE_TOKENS, COUNT, SETTINGS[0])
    assert total_variation(first, target_probs(rows[0], SETTINGS[0])) > BOUND


def test_the_bound_catches_accept_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifier, "_sampled_hits", lambda logprobs, layout, *rest: torch.ones_like(layout.tokens) > 0)
    first, rows = sampled_first_tokens(CHAIN, [2, 3, 1], COUNT, SETTINGS[0])
    assert total_variation(first, target_probs(rows[0], SETTINGS[0])) > BOUND


def test_second_token_follows_the_accepted_draft_row() -> None:
    """Given the first draft was accepted, the next token is distributed as row 1's p."""
    _, rows = sampled_first_tokens(CHAIN, [2, 3, 1], COUNT, SETTINGS[0])
    torch.manual_seed(1)
    logits = (torch.randn(4, VOCAB) * 1.5).repeat(COUNT, 1)
    layout = layout_of([[2, 3, 1]] * COUNT, CHAIN, chain=True)
    sampling = SamplingTensors.build([SETTINGS[0]] * COUNT, list(range(COUNT)), torch.device("cpu"))
    verdict = verify(logits, layout, sampling, torch.full((COUNT,), 7))
    second = verdict.emitted[verdict.accepted >= 1, 1]
    assert second.shape[0] > 1000
    assert total_variation(second, target_probs(rows[1], SETTINGS[0])) < 3 * BOUND


def test_draws_do_not_depend_on_the_batch() -> None:
    """A request's verdict is the same alone and among others (its seed and root position are its key)."""
    torch.manual_seed(2)
    logits = torch.randn(7 * (len(TREE) + 1), VOCAB)
    tokens = torch.randint(0, VOCAB, (7, len(TREE))).tolist()
    settings = [SETTINGS[i % 3] for i in range(7)]
    seeds, keys = [11 * i + 3 for i in range(7)], torch.arange(7) * 5 + 40
    together = verify(
        logits, layout_of(tokens, TREE), SamplingTensors.build(settings, seeds, torch.device("cpu")), keys, sort=True
    )
    rows = len(TREE) + 1
    for i in range(7):
        alone = verify(
            logits[i * rows : (i + 1) * rows], layout_of([tokens[i]], TREE),
            SamplingTensors.build([settings[i]], [seeds[i]], torch.device("cpu")), keys[i : i + 1], sort=True,
        )  # fmt: skip
        assert alone.accepted.item() == together.accepted[i].item()
        count = alone.accepted.item() + 1
        assert alone.emitted[0, :count].tolist() == together.emitted[i, :count].tolist()


def test_logprobs_match_target_probs() -> None:
    torch.manual_seed(3)
    logits = torch.randn(5, 50) * 3
    for params in SETTINGS:
        found = sampling_logprobs(logits, SamplingTensors.build([params] * 5, [0] * 5, logits.device).params, True)
        torch.testing.assert_close(found.exp(), target_probs(logits, params), atol=1e-6, rtol=1e-5)
