"""The data rounds: self-instruct requests, first turns, follow-up turns that carry the target's own answers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from executor_service.models.config import ModelConfig
from executor_service.models.gguf_loader import open_gguf, packaged_smollm2_path, read_metadata
from executor_service.models.gguf_tokenizer import chat_template, gguf_tokenizer
from executor_service.models.loader import LoadedModel, build_synthetic
from specdec_training import datagen
from specdec_training.prompts import ChatRenderer, Prompt
from specdec_training.rounds import (
    RoundsPlan,
    answered_prompts,
    generate_rounds,
    read_rounds,
    round_path,
)
from specdec_training.self_instruct import STYLES, TOPICS, parse_request, seed_requests, unique_requests


def test_parse_request_keeps_requests_and_drops_the_rest() -> None:
    assert parse_request('Question: "How do volcanoes form?"\n\nThey form when...') == "How do volcanoes form?"
    assert parse_request("**Request:** Explain recursion to a beginner.") == "Explain recursion to a beginner."
    assert parse_request("Why?") is None  # too short
    assert parse_request("Sure! Here is a question about bees: why do bees dance?") is None
    assert parse_request("x" * 401) is None
    kept = unique_requests([("instruction", "Why is the sky blue?"), ("code", "why is  the SKY blue?"), ("x", None)])
    assert kept == [("instruction", "Why is the sky blue?")]


def test_seed_requests_cover_topics_and_styles_deterministically() -> None:
    seeds = seed_requests(len(TOPICS) * len(STYLES) + 5, seed=3)
    assert seeds == seed_requests(len(TOPICS) * len(STYLES) + 5, seed=3)
    assert seeds != seed_requests(len(TOPICS) * len(STYLES) + 5, seed=4)
    first_pass = {text for _, text in seeds[: len(TOPICS) * len(STYLES)]}
    assert len(first_pass) == len(TOPICS) * len(STYLES)  # every pairing once before any repeats


@pytest.fixture(scope="module")
def tokenized_target() -> tuple[LoadedModel, ChatRenderer]:
    """A random two-layer model over SmolLM2's real tokenizer and chat template: real rendering, fast steps."""
    metadata = read_metadata(open_gguf(packaged_smollm2_path(), "test"))
    tokenizer = gguf_tokenizer(metadata)
    config = ModelConfig(
        architecture="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=2, num_kv_heads=1, head_size=16, max_position_embeddings=2048, rope_theta=10000.0,
    )  # fmt: skip
    loaded = dataclasses.replace(build_synthetic(config, 0, torch.float32, torch.device("cpu")), tokenizer=tokenizer)
    return loaded, ChatRenderer(tokenizer, chat_template(metadata))


def test_rounds_answer_follow_ups_with_the_earlier_turns_and_resume(
    tokenized_target: tuple[LoadedModel, ChatRenderer], tmp_path: Path
) -> None:
    loaded, renderer = tokenized_target
    prompts = [
        Prompt("instruction", "Summarize the story of Jonah.", "a", ("Now explain it to a child.", "Why?")),
        Prompt("code", "Write a Python function `add(a, b)`.", "b", ("Now write a short test for it.",)),
        Prompt("prose", "Continue: The sea was calm that night.", "c"),
        Prompt("prose", "x " * 400, "d"),  # longer than max_prompt_tokens: skipped
    ]
    settings = datagen.GenerationSettings(max_new_tokens=6, temperatures=(0.0, 0.7), chunk=8, progress=False)
    plan = RoundsPlan(self_instruct=6, max_prompt_tokens=128, max_context_tokens=512)
    data = tmp_path / "data.jsonl"
    outcome = generate_rounds(loaded, renderer, prompts, plan, settings, torch.device("cpu"), data)

    extra = outcome.counts["self_instruct_prompts"]
    assert outcome.counts["self_instruct_written"] == 6 and outcome.counts["skipped_too_long"] == 1
    assert outcome.counts["first_turns"] == 3 + extra == len(outcome.prompts)
    assert outcome.counts["turn2"] == 2 and outcome.counts["turn3"] == 1
    assert len(outcome.sequences) == 6 + 3 + extra + 2 + 1
    by_text = {p.text: s for p, s in zip(outcome.prompts, outcome.sequences[6 : 6 + len(outcome.prompts)], strict=True)}

    # The second turns, in the (shuffled) order of their conversations: each the first turn, its answer, the
    # follow-up.
    def second_turn(prompt: Prompt) -> list[int]:
        answer = loaded.tokenizer.decode(by_text[prompt.text].response, skip_special_tokens=True)
        return renderer.messages([
            {"role": "user", "content": prompt.text},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": prompt.followups[0]},
        ])  # fmt: skip

    expected = {prompt.text: second_turn(prompt) for prompt in prompts[:2]}
    second_turns = outcome.sequences[6 + len(outcome.prompts) : 6 + len(outcome.prompts) + 2]
    assert sorted(t.prompt for t in second_turns) == sorted(expected.values())
    assert all(len(t.response) > 0 for t in second_turns)
    turn2 = next(t for t in second_turns if t.prompt == expected[prompts[0].text])  # Jonah's, which goes on
    turn3 = outcome.sequences[-1]
    assert turn3.prompt[: len(turn2.prompt)] == turn2.prompt  # the conversation grows turn by turn
    assert "Why?" in loaded.tokenizer.decode(turn3.prompt)

    for name in ("self_instruct", "turn2", "turn3"):
        assert round_path(data, name).exists()
    # what --extra-data reads from another run's files: every round, in the order generation returned them
    assert [s.ids for s in read_rounds(data)] == [s.ids for s in outcome.sequences]
    again = generate_rounds(loaded, renderer, prompts, plan, settings, torch.device("cpu"), data)
    assert [s.ids for s in again.sequences] == [s.ids for s in outcome.sequences]  # read back, not regenerated


def test_prompts_another_run_answered_are_skipped(
    tokenized_target: tuple[LoadedModel, ChatRenderer], tmp_path: Path
) -> None:
    """--skip-answered: text written with another seed answers only the prompts the other run's text left."""
    loaded, renderer = tokenized_target
    prompts = [Prompt("prose", f"Continue: the {word} was calm that night.", word) for word in ("sea", "sky", "town")]
    settings = datagen.GenerationSettings(max_new_tokens=4, temperatures=(0.0,), chunk=8, progress=False)
    first = generate_rounds(
        loaded, renderer, prompts[:2], RoundsPlan(), settings, torch.device("cpu"), tmp_path / "a.jsonl"
    )
    answered = answered_prompts(tmp_path / "a.jsonl")
    assert answered == {tuple(s.prompt) for s in first.sequences} and len(answered) == 2
    plan = RoundsPlan(answered=answered)
    second = generate_rounds(loaded, renderer, prompts, plan, settings, torch.device("cpu"), tmp_path / "b.jsonl")
    assert second.counts["skipped_answered"] == 2 and second.counts["first_turns"] == 1
    assert second.prompts == [prompts[2]] and second.sequences[0].prompt == renderer(prompts[2].text)


def test_long_sequences_lose_their_prompt_start_first() -> None:
    from specdec_training.features import Sequence, collate

    short = Sequence([1, 2, 3], [4, 5])
    long_prompt = Sequence(list(range(10, 20)), [7, 8, 9])  # 13 tokens, max 6: keep the prompt's last 3
    long_response = Sequence([1, 2], list(range(30, 40)))  # the response alone is longer than 6
    batch = collate([short, long_prompt, long_response], max_len=6, device=torch.device("cpu"))
    assert batch.ids[0, :5].tolist() == [1, 2, 3, 4, 5] and batch.response_start[0] == 3
    assert batch.ids[1].tolist() == [17, 18, 19, 7, 8, 9] and batch.response_start[1] == 3
    assert batch.ids[2].tolist() == [30, 31, 32, 33, 34, 35] and batch.response_start[2] == 0
    assert batch.lengths.tolist() == [5, 6, 6]


def test_a_passed_generation_deadline_keeps_what_is_done(
    tokenized_target: tuple[LoadedModel, ChatRenderer], tmp_path: Path
) -> None:
    loaded, _ = tokenized_target
    prompts = [datagen.PromptIds("random", [5 + i, 6, 7]) for i in range(5)]
    settings = datagen.GenerationSettings(max_new_tokens=3, temperatures=(0.0,), chunk=2, progress=False)
    path = tmp_path / "data.jsonl"
    assert len(datagen.generate(loaded, prompts[:2], settings, torch.device("cpu"), path)) == 2
    late = dataclasses.replace(settings, deadline=0.0)  # long past: no new chunk starts
    assert len(datagen.generate(loaded, prompts, late, torch.device("cpu"), path)) == 2
    assert len(datagen.generate(loaded, prompts, settings, torch.device("cpu"), path)) == 5


def test_a_time_budget_shortens_the_run_to_what_fits() -> None:
    from specdec_training.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # only the step arithmetic: no model needed
    trainer.step, trainer.total_steps, trainer.time_budget, trainer.step_cap = 30, 1000, 60.0, None
    assert trainer.fit_to_budget(elapsed=10.0, per_step=0.5) == 30 + 100  # 50 s left at 0.5 s a step
    trainer.total_steps, trainer.time_budget, trainer.step_cap = 50, 600.0, None
    assert trainer.fit_to_budget(elapsed=10.0, per_step=0.5) == 50  # never more than the recipe's
    trainer.total_steps, trainer.time_budget, trainer.step_cap = 1000, 5.0, None
    assert trainer.fit_to_budget(elapsed=10.0, per_step=0.5) == 31  # over budget already: one more step, then stop


def test_a_time_budget_is_fitted_again_as_the_pace_changes() -> None:
    """Runs sharing a GPU speed up when the others finish: a later fit lengthens the run again, up to the cap
    that the recipe (or --max-steps) set, never past it."""
    from specdec_training.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.step, trainer.total_steps, trainer.time_budget, trainer.step_cap = 30, 1000, 100.0, None
    assert trainer.fit_to_budget(elapsed=10.0, per_step=1.0) == 30 + 90  # slow at first: 90 s left
    trainer.step = 100
    assert trainer.fit_to_budget(elapsed=50.0, per_step=0.1) == 100 + 500  # faster now: 50 s at 0.1 s
    trainer.step = 200
    assert trainer.fit_to_budget(elapsed=55.0, per_step=0.01) == 1000  # the recipe's total stays the cap


def grouping_trainer(lengths: list[int], batch_size: int, seed: int = 0):
    """A Trainer with only what `batch` reads: sequences of the given lengths, the batch size and max_len."""
    from specdec_training.features import Sequence
    from specdec_training.recipes import RECIPES, with_overrides
    from specdec_training.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.sequences = [Sequence([1], [2] * (n - 1)) for n in lengths]
    trainer.recipe = with_overrides(RECIPES["eagle3"], batch_size=batch_size, max_len=1024)
    trainer.seed, trainer._orders = seed, {}
    trainer.batches_per_epoch = -(-len(lengths) // batch_size)
    return trainer


def test_batches_group_sequences_of_similar_length_and_see_each_once_per_epoch() -> None:
    """A batch is padded to its longest row: random batches of 40- to 1024-token sequences are mostly padding.
    Grouping by length within windows of the shuffled order cuts the padded tokens, every sequence is still seen
    once per epoch, and the order depends on the seed and the epoch alone."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(40, 1024) for _ in range(3000)]
    trainer = grouping_trainer(lengths, batch_size=16)
    steps = trainer.batches_per_epoch
    for epoch in range(2):
        batches = trainer._epoch_batches(epoch)
        assert len(batches) == steps
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    padded = sum(len(b) * max(min(lengths[i], 1024) for i in b) for b in trainer._epoch_batches(0))
    random_order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    random_padded = sum(16 * max(lengths[i] for i in random_order[s : s + 16]) for s in range(0, len(lengths), 16))
    assert padded < 0.7 * random_padded
    assert padded < 1.1 * sum(lengths)  # nearly no padding left
    first = [[len(s.ids) for s in trainer.batch(step)] for step in range(3)]
    again = grouping_trainer(lengths, batch_size=16)
    assert [[len(s.ids) for s in again.batch(step)] for step in range(3)] == first
    assert trainer._epoch_batches(0) != trainer._epoch_batches(1)
    assert grouping_trainer(lengths, 16, seed=1)._epoch_batches(0) != trainer._epoch_batches(0)
