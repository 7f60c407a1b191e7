"""The one verifier (verifier.py): the greedy rule against the host's walk, the sampled rule's output distribution
against the target's (total variation), its emitted tokens those of target-only decoding (each row's draw, keyed
by its position), accepted drafts always the emitted tokens (with negative controls that must fail), and
counter-based draws that do not depend on the batch."""

from __future__ import annotations

import pytest
import torch
from sampling_reference import reference_probs
from verify_reference import accepts_all, greedy_walk, independent_hits

from executor_service.sample.device_sampling import SamplingTensors, StepKeys
from executor_service.sample.sampling import SamplingSettings, host_sort, sampling_params, target_logprobs, target_probs
from executor_service.spec_decode import verifier
from executor_service.spec_decode.host_verify import DraftTree
from executor_service.spec_decode.verifier import DraftLayout, tree_layout, verify, verify_host_greedy

VOCAB = 6
CPU = torch.device("cpu")
CHAIN = [-1, 0, 1]  # three drafts in a chain
TREE = [-1, -1, -1, 0, 0, 3]  # the root's children 0, 1, 2 (2 repeats 0's token below); 3, 4 under 0; 5 under 3
TREE_TOKENS = [1, 2, 1, 3, 0, 4]
NO_DRAFTS = DraftLayout(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.int64), None, None, 0, True)


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
            verdict = verify(logits, layout, None, None)
            path, emitted = greedy_walk(tokens.tolist(), parents, logits.argmax(-1).tolist())
            assert verdict.accepted.item() == len(path)
            assert verdict.emitted[0, : len(emitted)].tolist() == emitted


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_host_batches_of_uneven_drafts_walk_as_the_reference(shape: str) -> None:
    """verify_host_greedy: requests with 0 to 8 drafts in one batch (padded to the longest), rows request after
    request, each request's verdict the reference walk's."""
    rng = torch.Generator().manual_seed(3)
    for _ in range(20):
        sizes = torch.randint(0, 9, (6,), generator=rng).tolist()
        tokens, parents, argmax, starts = [], [], [], []
        for size in sizes:
            request_parents = list(range(-1, size - 1))
            if shape == "tree":
                request_parents = [int(torch.randint(-1, j, (1,), generator=rng)) if j else -1 for j in range(size)]
            starts.append(len(argmax))
            argmax += torch.randint(0, 3, (size + 1,), generator=rng).tolist()
            tokens.append(torch.randint(0, 3, (size,), generator=rng).tolist())
            parents.append(request_parents)
        verdict = verify_host_greedy(torch.tensor(argmax), starts, tokens, parents if shape == "tree" else None)
        for i, (request_tokens, request_parents) in enumerate(zip(tokens, parents, strict=True)):
            rows = argmax[starts[i] : starts[i] + len(request_tokens) + 1]
            path, emitted = greedy_walk(request_tokens, request_parents, rows)
            count = int(verdict.accepted[i])
            assert count == len(path), (request_tokens, request_parents, rows)
            assert verdict.emitted[i, : count + 1].tolist() == emitted
            assert [r - 1 for r in verdict.path_rows[i, 1 : count + 1].tolist()] == path


def test_greedy_chain_verification() -> None:
    """A chain accepts while its drafts are the target's argmax, then emits the target's own token."""
    argmax = [5, 6, 7, 8, 5, 6, 7, 8, 3]
    verdict = verify_host_greedy(torch.tensor(argmax), [0, 4, 8], [[5, 6, 7], [5, 9, 7], []], None)
    assert verdict.accepted.tolist() == [3, 1, 0]
    assert verdict.emitted[0].tolist() == [5, 6, 7, 8]
    assert verdict.emitted[1, :2].tolist() == [5, 6]
    assert verdict.emitted[2, :1].tolist() == [3]


def sampled_first_tokens(parents: list[int], tokens: list[int], count: int, params: SamplingSettings) -> torch.Tensor:
    """The first emitted token of `count` requests with the same rows and different seeds."""
    torch.manual_seed(1)
    rows = len(parents) + 1
    logits = (torch.randn(rows, VOCAB) * 1.5).repeat(count, 1)
    layout = layout_of([tokens] * count, parents, chain=parents is CHAIN)
    sampling = SamplingTensors.build([params] * count, list(range(count)), torch.device("cpu"))
    sort = params.top_k > 0 or params.top_p < 1.0
    keys = StepKeys.on_device(sampling.seed, torch.full((count,), 7), layout.depth)
    verdict = verify(logits, layout, sampling, keys, sort=sort)
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


def sampled_verdicts(parents: list[int], seed: int) -> tuple[torch.Tensor, DraftLayout, verifier.Verdict]:
    """64 requests' random rows and drafts (often the rows' likely tokens, so that paths get long) verified with
    sampled settings of each kind, roots at 40 + i; the logits [64 * rows, V] and layout too."""
    generator = torch.Generator().manual_seed(seed)
    count, rows = 64, len(parents) + 1
    logits = torch.randn(count * rows, VOCAB, generator=generator) * 2
    tokens = logits.view(count, rows, VOCAB)[:, :-1].argmax(-1)
    tokens = torch.where(torch.rand(tokens.shape, generator=generator) < 0.3, (tokens + 1) % VOCAB, tokens)
    layout = layout_of(tokens.tolist(), parents, chain=parents is CHAIN)
    sampling = SamplingTensors.build([SETTINGS[i % 3] for i in range(count)], list(range(count)), CPU)
    keys = StepKeys.on_device(sampling.seed, torch.arange(count) + 40, layout.depth)
    return logits, layout, verify(logits, layout, sampling, keys, sort=True)


@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampled_tokens_are_the_draws_of_target_only_decoding(parents: list[int]) -> None:
    """Each emitted token is what a decode step without drafts draws from the row it comes from, keyed by its own
    position: the accepted drafts' rows, then the path's last row; the accepted drafts are the tokens emitted."""
    logits, layout, verdict = sampled_verdicts(parents, 5)
    count, rows = layout.tokens.shape[0], len(parents) + 1
    assert int(verdict.accepted.sum()) > 0 and (verdict.accepted < layout.depth).any()
    for i in range(count):
        accepted = int(verdict.accepted[i])
        for j in range(accepted + 1):
            row = int(verdict.path_rows[i, j])
            one = SamplingTensors.build([SETTINGS[i % 3]], [i], CPU)
            alone = verify(
                logits[i * rows + row][None], NO_DRAFTS, one,
                StepKeys.on_device(one.seed, torch.tensor([40 + i + j])), sort=True,
            )  # fmt: skip
            assert int(verdict.emitted[i, j]) == int(alone.emitted[0, 0]), (i, j)
            if j < accepted:
                assert int(verdict.emitted[i, j]) == int(layout.tokens[i, int(verdict.path_rows[i, j + 1]) - 1])


@pytest.mark.parametrize("broken", [accepts_all, independent_hits], ids=["accepts-all", "independent"])
def test_a_hit_not_decided_by_the_draw_is_caught(broken: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: drafts accepted whatever the draw, or by a draw other than the one emitted, emit tokens
    that are not the accepted drafts (the target's later rows then read a text that was not emitted)."""
    monkeypatch.setattr(verifier, "_greedy_hits", broken)
    for parents in (CHAIN, TREE):
        _, layout, verdict = sampled_verdicts(parents, 5)
        path = verdict.path_rows[:, 1:]
        drafts = torch.cat([layout.tokens[:, :1], layout.tokens], dim=1).gather(1, path)
        on_path = torch.arange(path.shape[1])[None, :] < verdict.accepted[:, None]
        assert ((drafts != verdict.emitted[:, : path.shape[1]]) & on_path).any()


def test_second_token_follows_the_accepted_draft_row() -> None:
    """Given the first draft was accepted, the next token is distributed as row 1's p."""
    _, rows = sampled_first_tokens(CHAIN, [2, 3, 1], COUNT, SETTINGS[0])
    torch.manual_seed(1)
    logits = (torch.randn(4, VOCAB) * 1.5).repeat(COUNT, 1)
    layout = layout_of([[2, 3, 1]] * COUNT, CHAIN, chain=True)
    sampling = SamplingTensors.build([SETTINGS[0]] * COUNT, list(range(COUNT)), torch.device("cpu"))
    verdict = verify(logits, layout, sampling, StepKeys.on_device(sampling.seed, torch.full((COUNT,), 7), 3))
    second = verdict.emitted[verdict.accepted >= 1, 1]
    assert second.shape[0] > 1000
    assert total_variation(second, target_probs(rows[1], SETTINGS[0])) < 3 * BOUND


def test_draws_do_not_depend_on_the_batch() -> None:
    """A request's verdict is the same alone and among others (its seed and root position are its key)."""
    torch.manual_seed(2)
    logits = torch.randn(7 * (len(TREE) + 1), VOCAB)
    tokens = torch.randint(0, VOCAB, (7, len(TREE))).tolist()
    settings = [SETTINGS[i % 3] for i in range(7)]
    seeds, roots = [11 * i + 3 for i in range(7)], (torch.arange(7) * 5 + 40).tolist()
    together = verify(
        logits, layout_of(tokens, TREE), SamplingTensors.build(settings, seeds, torch.device("cpu")),
        StepKeys.on_host(seeds, roots, torch.device("cpu"), 3), sort=True,
    )  # fmt: skip
    rows = len(TREE) + 1
    for i in range(7):
        alone = verify(
            logits[i * rows : (i + 1) * rows], layout_of([tokens[i]], TREE),
            SamplingTensors.build([settings[i]], [seeds[i]], torch.device("cpu")),
            StepKeys.on_host([seeds[i]], [roots[i]], torch.device("cpu"), 3), sort=True,
        )  # fmt: skip
        assert alone.accepted.item() == together.accepted[i].item()
        count = alone.accepted.item() + 1
        assert alone.emitted[0, :count].tolist() == together.emitted[i, :count].tolist()


def test_the_target_distribution_matches_the_reference() -> None:
    """target_logprobs, sorted (the device steps), by top-k alone (host_sort) and unsorted where it may: the
    reference's distribution row by row; and each request's rows the same numbers in a batch of all of them."""
    torch.manual_seed(3)
    logits = torch.randn(5, 50) * 3
    settings = [*SETTINGS, SamplingSettings(temperature=0.8, min_p=0.1), SamplingSettings(temperature=0.9, top_k=7)]
    for params in settings:
        tensors = SamplingTensors.build([params] * 5, [0] * 5, logits.device).params
        expected = reference_probs(logits, params)
        for sort in {True, host_sort([params], 50)}:
            torch.testing.assert_close(target_logprobs(logits, tensors, sort).exp(), expected, atol=1e-6, rtol=1e-5)
    rows = torch.cat([logits] * len(settings))
    every = [s for s in settings for _ in range(5)]
    params = torch.tensor(sampling_params(every))
    together = target_logprobs(rows, params, True).exp().view(len(settings), 5, -1)
    for i, setting in enumerate(settings):
        assert torch.equal(together[i], target_probs(logits, setting))


def test_a_given_row_argmax_is_the_one_verify_uses() -> None:
    """`row_argmax` (a decode draw's checked argmax, passed to spare verify its own): the true argmax gives verify's
    own verdict; another one moves a greedy row's token to it (so it is what verify reads); with penalties, which
    change the argmax, it is refused."""
    torch.manual_seed(5)
    count = 4
    logits = torch.randn(count, VOCAB)
    empty = torch.zeros(count, 0, dtype=torch.int64)
    layout = DraftLayout(empty, empty, None, None, 0, True)
    settings = [SamplingSettings(), SamplingSettings(0.8), SamplingSettings(), SamplingSettings(1.0, top_k=3)]
    sampling = SamplingTensors.build(settings, list(range(count)), CPU)
    keys = StepKeys.on_host(list(range(count)), [9] * count, CPU)
    own = verify(logits, layout, sampling, keys, host_sort(settings, VOCAB))
    given = verify(logits, layout, sampling, keys, host_sort(settings, VOCAB), row_argmax=logits.argmax(-1))
    assert torch.equal(own.emitted, given.emitted) and torch.equal(own.accepted, given.accepted)
    other = (logits.argmax(-1) + 1) % VOCAB
    moved = verify(logits, layout, sampling, keys, host_sort(settings, VOCAB), row_argmax=other)
    assert moved.emitted[[0, 2], 0].tolist() == other[[0, 2]].tolist()
    penalties = object()  # refused before it is read
    with pytest.raises(ValueError, match="penalties change"):
        verify(logits, layout, sampling, keys, penalties=penalties, row_argmax=other)  # type: ignore[arg-type]
