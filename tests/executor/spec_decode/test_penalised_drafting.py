"""Penalised drafting (draft_penalties.py): a penalised request's drafts are picked under the penalties that the
target applies to the rows verifying them, on the device step and the host path, chains and trees.

- The drafts are penalised: a drafter whose logits are a fixed row (a large logit on a prompt token, smaller
  ones on three others) proposes, for a penalised request, each chain's sequential penalised argmax (the history
  plus the drafts before it, written out from the definitions: penalty_reference.py), for a plain one the raw
  argmax, for one with a logit bias (the prompt token banned, another lifted) the biased argmax; a tree's first
  level is the ranking under the history. EAGLE-3's reduced vocabulary is mapped: the prompt token is a draft id's
  target id, not the draft id itself. Negative control: with the penalty off in the drafter the same check fails
  (and without the bias in the drafter, every case fails on the biased request).
- Lossless: greedy penalised requests with the drafters' own drafts give the penalised reference token for token
  (EAGLE-1, EAGLE-3, DFlash; chains and trees; device step and host path); seeded sampled penalised requests give
  the same tokens alone and in a batch, argmax drafts and drafts drawn from q alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_driving import Collector
from executor_builders import greedy
from greedy_reference import greedy_reference
from penalty_reference import greedy_penalised, reference_logits
from spec_builders import spec_session
from tree_cases import TREES, tree_session

from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession
from executor_service.spec_decode.draft_penalties import DraftPenalties

MAX_TOKENS = 8
K = 3
PENALISED = greedy(MAX_TOKENS, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.5)
PLAIN = greedy(MAX_TOKENS)
# The fixed drafter row: X (in the prompt) beats the others unpenalised; penalised, X / 1.8 falls below the
# three others, and each of them below the next once drafted: a chain drafts Y, W, V; history alone, Y, Y, Y.
BONUS = (40.0, 36.0, 32.0, 28.0)


def session_for(method: str, shape: str, on_device: bool) -> ModelSession:
    if shape == "chain":
        session = spec_session(method, K, max_num_batched_tokens=64)
    else:
        tree, k = TREES[shape]
        session = tree_session(method, tree, k)
    session.engine.spec_step.counts.clear()  # the warm-up's steps
    session.engine.step_counts.clear()
    if not on_device:
        session.engine.spec_step = None
    return session


class FixedRowDrafter:
    """Makes the drafter's logits the fixed row (BONUS on `tokens`' draft ids, 0 on the rest of its vocabulary)
    and records every request's drafts as they are set, with its output then."""

    def __init__(self, session: ModelSession, tokens: list[int]) -> None:
        proposer, drafter = session.proposer, session.proposer.drafter
        vocab_ids = proposer.draft_vocab_ids()
        self.in_vocab = list(range(session.loaded.model.config.vocab_size)) if vocab_ids is None else vocab_ids.tolist()
        draft_ids = [self.in_vocab.index(t) for t in tokens]
        bonus = torch.tensor(BONUS)
        original = drafter.draft_logits

        def fixed(hidden: torch.Tensor) -> torch.Tensor:
            out = original(hidden) * 0
            out[..., draft_ids] = bonus.to(out.dtype)
            return out

        drafter.draft_logits = fixed
        self.tokens, self.vocab = tokens, session.loaded.model.config.vocab_size
        self.proposals: list[tuple[str, list[int], list[int], list[int]]] = []  # id, output, drafts, parents
        # Where drafts are set: a chain's on both paths (set_tree hands a chain's to it), a tree's.
        name = "set_drafts" if proposer.tree is None else "set_tree"
        original_set = getattr(proposer, name)

        def record(request: Any, *args: Any) -> None:
            original_set(request, *args)
            drafts, parents = list(request.draft_ids), proposer.tree_of(request)
            self.proposals.append((request.request_id, list(request.output_ids), drafts, parents))

        setattr(proposer, name, record)

    def row(self) -> torch.Tensor:
        """The fixed row in the target's ids: outside the drafter's vocabulary, never drafted (-inf)."""
        row = torch.full((self.vocab,), float("-inf"), dtype=torch.float64)
        row[self.in_vocab] = 0.0
        row[self.tokens] = torch.tensor(BONUS, dtype=torch.float64)
        return row

    def chain(self, prompt: list[int], output: list[int], settings: SamplingSettings, count: int) -> list[int]:
        """The reference chain: each draft the argmax under the history and the drafts before it."""
        drafts: list[int] = []
        for _ in range(count):
            values = reference_logits(self.row(), prompt, output + drafts, settings)
            best = int(values.argmax())
            assert values[best] > 0  # above every id the row leaves at 0: the drafter's argmax is the same
            drafts.append(best)
        return drafts

    def ranking(self, prompt: list[int], output: list[int], settings: SamplingSettings, count: int) -> list[int]:
        """A tree's first level: the best `count` ids under the history alone."""
        values = reference_logits(self.row(), prompt, output, settings)
        return [int(i) for i in values.topk(count).indices]


def pick_tokens(session: ModelSession) -> tuple[list[int], list[int]]:
    """X, Y, W, V and a prompt holding X twice. With EAGLE-3 each is a draft id's target id other than the draft
    id itself, and no draft id of the four is in the prompt: counts read at draft ids would miss X."""
    vocab_ids = session.proposer.draft_vocab_ids()
    if vocab_ids is None:
        tokens = [11, 23, 37, 41]
    else:
        moved = [d for d, t in enumerate(vocab_ids.tolist()) if t != d]
        tokens = [int(vocab_ids[d]) for d in moved[:4]]
    avoid = set(tokens) | ({vocab_ids.tolist().index(t) for t in tokens} if vocab_ids is not None else set())
    others = [t for t in range(3, 60) if t not in avoid][:3]
    return tokens, [tokens[0], others[0], others[1], tokens[0], others[2]]


def drafted_mismatches(method: str, shape: str, on_device: bool) -> tuple[int, int]:
    """Runs a penalised and a plain request beside each other under the fixed row; (proposals that differ from the
    reference, proposals checked)."""
    session = session_for(method, shape, on_device)
    tokens, prompt = pick_tokens(session)
    fixed = FixedRowDrafter(session, tokens)
    biased = greedy(MAX_TOKENS, logit_bias=((tokens[0], -100.0), (tokens[3], 15.0)))  # X banned, V lifted first
    batch = {"penalised": (prompt, PENALISED), "plain": (prompt, PLAIN), "biased": (prompt, biased)}
    sink = Collector()
    for rid, (request_prompt, settings) in batch.items():
        session.engine.add(session.new_request(rid, request_prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    assert all(len(sink.tokens(rid)) == MAX_TOKENS for rid in batch)
    if on_device:
        assert session.engine.spec_step.counts["extras"] > 0 and not session.engine.step_counts["host drafts"]
    else:
        assert session.engine.step_counts["host drafts"] > 0
    wrong = checked = 0
    for rid, output, drafts, parents in fixed.proposals:
        if not drafts:
            continue
        request_prompt, settings = batch[rid]
        if shape == "chain":
            expected = fixed.chain(request_prompt, output, settings, len(drafts))
            found = drafts
        else:
            first_level = [token for token, parent in zip(drafts, parents, strict=True) if parent == -1]
            expected, found = fixed.ranking(request_prompt, output, settings, len(first_level)), first_level
        checked += 1
        wrong += found != expected
    return wrong, checked


CASES = [
    ("eagle", "chain"),
    ("eagle3", "chain"),
    ("dflash", "chain"),
    ("eagle3", "static_2_2_1"),
    ("eagle3", "dynamic_3_budget_8_depth_4"),
    ("dflash", "static_2_2_1"),
    ("dflash", "dynamic_3_budget_8_depth_4"),
]


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize(("method", "shape"), CASES)
def test_a_penalised_requests_drafts_are_penalised(method: str, shape: str, on_device: bool) -> None:
    wrong, checked = drafted_mismatches(method, shape, on_device)
    assert checked >= 4 and wrong == 0, (wrong, checked)


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize(("method", "shape"), [("eagle3", "chain"), ("dflash", "chain"), ("eagle3", "static_2_2_1")])
def test_the_check_catches_a_drafter_without_penalties(
    method: str, shape: str, on_device: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the penalty off in the drafter (its logits as they are), the penalised request drafts
    the raw argmax, and the same check fails."""
    monkeypatch.setattr(DraftPenalties, "apply", lambda self, logits: logits.float())
    wrong, checked = drafted_mismatches(method, shape, on_device)
    assert checked >= 4 and wrong > 0, (wrong, checked)


PENALISED_KINDS = [
    greedy(MAX_TOKENS, repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0),
    PLAIN,
    greedy(MAX_TOKENS, repetition_penalty=0.6, frequency_penalty=-0.8, logprobs=0),
    greedy(MAX_TOKENS, repetition_penalty=1.2),
]


def short_prompts(count: int) -> dict[str, list[int]]:
    """Prompts over a few ids, so that the penalties meet repeated tokens."""
    generator = torch.Generator().manual_seed(3)
    return {f"r{i}": torch.randint(12, (3 + 2 * i,), generator=generator).tolist() for i in range(count)}


@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize(
    ("method", "shape"), [("eagle", "chain"), ("eagle", "static_2_2_1"), *CASES[1:]], ids=lambda v: str(v)
)
def test_penalised_greedy_with_penalised_drafts_equals_target_only(method: str, shape: str, on_device: bool) -> None:
    """The drafters' own drafts, penalised: every request keeps its penalised (or plain) reference."""
    session = session_for(method, shape, on_device)
    batch = {rid: (p, PENALISED_KINDS[i % 4]) for i, (rid, p) in enumerate(short_prompts(8).items())}
    sink = Collector()
    for rid, (prompt, settings) in batch.items():
        session.engine.add(session.new_request(rid, prompt, settings, MAX_TOKENS, sink))
    session.engine.run_until_idle()
    model = session.loaded.model
    for rid, (prompt, settings) in batch.items():
        expected = greedy_penalised(model, prompt, MAX_TOKENS, settings) if settings.has_penalties else None
        assert sink.tokens(rid) == (expected or greedy_reference(model, prompt, MAX_TOKENS)), rid
        assert sink.outputs[rid][-1].finish.verify_steps > 0
    if on_device:  # some steps of a tree cut short by the token budget take the host path beside
        assert session.engine.spec_step.counts["extras"] > 0
    else:
        assert session.engine.step_counts["host drafts"] > 0
    assert session.kv_cache.allocator.num_used == 0


SAMPLED = SamplingSettings(
    temperature=0.8, top_p=0.9, seed=5, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=MAX_TOKENS
)
COMPANIONS = [PLAIN, SamplingSettings(temperature=0.7, top_k=50, seed=9), greedy(MAX_TOKENS, repetition_penalty=1.2)]


@pytest.mark.parametrize("sampled_drafts", ["auto", "on"], ids=["argmax-drafts", "drawn-drafts"])
@pytest.mark.parametrize("on_device", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_seeded_penalised_request_is_the_same_alone_and_in_a_batch(
    method: str, on_device: bool, sampled_drafts: str
) -> None:
    """Under the fixed row, where penalised drafts differ from the raw argmax: the same tokens, and the same drafts
    at every step, alone and beside companions (greedy, sampled, penalised), on either path."""
    found, drafted = [], []
    for companions in ([], COMPANIONS):
        session = spec_session(method, K, max_num_batched_tokens=64, sampled_drafts=sampled_drafts)
        if not on_device:
            session.engine.spec_step = None
        tokens, prompt = pick_tokens(session)
        fixed = FixedRowDrafter(session, tokens)
        sink = Collector()
        for i, settings in enumerate(companions):
            session.engine.add(session.new_request(f"c{i}", [*prompt[1:], 4 + i], settings, MAX_TOKENS, sink))
        session.engine.add(session.new_request("seeded", prompt, SAMPLED, MAX_TOKENS, sink))
        session.engine.run_until_idle()
        assert sink.outputs["seeded"][-1].finish.verify_steps > 0
        found.append(sink.tokens("seeded"))
        drafted.append([(output, drafts) for rid, output, drafts, _ in fixed.proposals if rid == "seeded"])
    assert len(found[0]) == MAX_TOKENS and found[0] == found[1]
    assert len(drafted[0]) >= 4 and drafted[0] == drafted[1]
