"""The target writes its training text in rounds: self-instruct requests, first turns, follow-up turns.

1. self-instruct (optional): from seed topics and styles the target writes requests at temperature 1.0;
   those that read like a request join the prompts (self_instruct.py).
2. first turns: every prompt, answered greedily or sampled (temperatures taken in turn).
3. follow-ups: prompts that carry later user turns become conversations: the earlier turns, with the
   target's own answers, are rendered with the chat template and the target answers the next turn.

Every round is target-written text, so every round's sequences train the drafter. Each round has its own
file beside `data` (the first turns use `data` itself) and resumes where it stopped, as datagen does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from executor_service.models.loader import LoadedModel
from specdec_training import datagen
from specdec_training.features import Sequence
from specdec_training.prompts import ChatRenderer, Prompt
from specdec_training.self_instruct import parse_request, seed_requests, unique_requests

WRITER_TEMPERATURE, WRITER_MAX_TOKENS = 1.0, 96  # self-instruct: varied, short requests


@dataclass(frozen=True)
class RoundsPlan:
    self_instruct: int = 0  # seed requests the target writes prompts from
    max_prompt_tokens: int = 640  # first-turn prompts longer than this are skipped
    max_context_tokens: int = 1536  # a conversation is not continued past this many prompt tokens
    # rendered first-turn prompts another run's text already answers (--skip-answered): skipped, so text written
    # with another seed is new text, not the same prompts again (greedy answers to them would be identical)
    answered: frozenset[tuple[int, ...]] = frozenset()


@dataclass
class RoundsOutcome:
    sequences: list[Sequence]
    prompts: list[Prompt]  # the first-turn prompts answered (corpus and self-instruct)
    counts: dict[str, int]  # sequences per round, and prompts skipped


def round_path(data: Path, name: str) -> Path:
    return data.with_name(f"{data.stem}.{name}{data.suffix}")


def answered_prompts(data: Path) -> frozenset[tuple[int, ...]]:
    """The first-turn prompts (rendered ids) that `data`, another run's text, answers."""
    return frozenset(tuple(sequence.prompt) for sequence in datagen.read_sequences(data))


def read_rounds(data: Path) -> list[Sequence]:
    """Every round's sequences that `data` and the round files beside it hold (missing files hold none), in the
    order generate_rounds returns them: text another run wrote, to train on beside this run's (--extra-data)."""
    paths = [round_path(data, "self_instruct"), data, round_path(data, "turn2"), round_path(data, "turn3")]
    return [sequence for path in paths for sequence in datagen.read_sequences(path)]


def generate_rounds(
    loaded: LoadedModel,
    renderer: ChatRenderer,
    prompts: list[Prompt],
    plan: RoundsPlan,
    settings: datagen.GenerationSettings,
    device: torch.device,
    data: Path,
) -> RoundsOutcome:
    counts: dict[str, int] = {}
    sequences: list[Sequence] = []
    if plan.self_instruct:
        written, extra = _self_instruct(loaded, renderer, plan.self_instruct, settings, device, data)
        sequences += written
        counts["self_instruct_written"], counts["self_instruct_prompts"] = len(written), len(extra)
        prompts = _spread(prompts, extra, settings.seed)

    rendered = [(p, renderer(p.text)) for p in prompts]
    new = [(p, ids) for p, ids in rendered if tuple(ids) not in plan.answered]
    kept = [(p, ids) for p, ids in new if len(ids) <= plan.max_prompt_tokens]
    counts["skipped_answered"], counts["skipped_too_long"] = len(rendered) - len(new), len(new) - len(kept)
    ids = [datagen.PromptIds(p.kind, i) for p, i in kept]
    first = datagen.generate(loaded, ids, settings, device, data)
    kept = kept[: len(first)]  # fewer when the deadline came first
    sequences += first
    counts["first_turns"] = len(first)

    # Conversations: (prompt, messages so far) for prompts whose next user turn exists.
    talks = [(p, [_user(p.text), _assistant(loaded, s.response)]) for (p, _), s in zip(kept, first, strict=True)]
    for turn in (1, 2):
        talks = [(p, m) for p, m in talks if len(p.followups) >= turn]
        asked = [(p, [*m, _user(p.followups[turn - 1])]) for p, m in talks]
        rendered_turns = [(p, m, renderer.messages(m)) for p, m in asked]
        rendered_turns = [t for t in rendered_turns if len(t[2]) <= plan.max_context_tokens]
        if not rendered_turns:
            break
        turn_ids = [datagen.PromptIds(p.kind, i) for p, _, i in rendered_turns]
        answered = datagen.generate(loaded, turn_ids, settings, device, round_path(data, f"turn{turn + 1}"))
        rendered_turns = rendered_turns[: len(answered)]
        sequences += answered
        counts[f"turn{turn + 1}"] = len(answered)
        pairs = zip(rendered_turns, answered, strict=True)
        talks = [(p, [*m, _assistant(loaded, s.response)]) for (p, m, _), s in pairs]
    return RoundsOutcome(sequences, [p for p, _ in kept], counts)


def _self_instruct(
    loaded: LoadedModel,
    renderer: ChatRenderer,
    count: int,
    settings: datagen.GenerationSettings,
    device: torch.device,
    data: Path,
) -> tuple[list[Sequence], list[Prompt]]:
    seeds = seed_requests(count, settings.seed)
    ids = [datagen.PromptIds("self-instruct", renderer(text)) for _, text in seeds]
    writer = replace(settings, temperatures=(WRITER_TEMPERATURE,), max_new_tokens=WRITER_MAX_TOKENS)
    written = datagen.generate(loaded, ids, writer, device, round_path(data, "self_instruct"))
    kinds = [kind for kind, _ in seeds[: len(written)]]  # fewer written when the deadline came first
    parsed = [(kind, parse_request(_text(loaded, s.response))) for kind, s in zip(kinds, written, strict=True)]
    prompts = [Prompt(kind, text, f"self-instruct:{i}") for i, (kind, text) in enumerate(unique_requests(parsed))]
    return written, prompts


def _spread(prompts: list[Prompt], extra: list[Prompt], seed: int) -> list[Prompt]:
    """`prompts` and `extra` shuffled together (seeded), so any prefix holds a share of both. The prompts' own
    order is not kept: to answer only some of them, cut them before (--num-prompts, --skip-answered)."""
    merged = [*prompts, *extra]
    random.Random(f"{seed}:spread").shuffle(merged)
    return merged


def _text(loaded: LoadedModel, ids: list[int]) -> str:
    assert loaded.tokenizer is not None
    return loaded.tokenizer.decode(ids, skip_special_tokens=True)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(loaded: LoadedModel, response: list[int]) -> dict[str, str]:
    return {"role": "assistant", "content": _text(loaded, response)}
