"""Prompts of three kinds from the corpus, a held-out split, and their rendering for the target.

- instruction: summarize / explain / question a prose passage, or explain a standard-library function;
- prose: continue a passage;
- code: write a function from its signature and docstring summary, or complete its opening lines.

Every passage or function lands in the held-out pool or the training pool by a hash of (seed, its key),
so the two never share text, and the held-out prompts (the acceptance benchmark's) depend only on the
corpus and the seed, not on how many training prompts are asked for.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from executor_service.gguf_tokenizer import render_chat
from executor_service.training.corpus import Function, Passage, prose_passages, stdlib_functions

KINDS = ("instruction", "prose", "code")
HELD_OUT_PERCENT = 5
INSTRUCTIONS = (
    "Summarize the following passage in a few sentences.\n\n{}",
    "Explain what this passage means in plain modern English.\n\n{}",
    "What is the main idea of the following text?\n\n{}",
    "Write three questions about the following text, then answer them.\n\n{}",
    "Rewrite the following passage in simple modern English.\n\n{}",
    "List the people, places and things mentioned in this passage.\n\n{}",
)
CONTINUATIONS = (
    "Continue the following text.\n\n{}",
    "Continue this story in the same style.\n\n{}",
    "Write the next paragraph of this text.\n\n{}",
)
FENCE = "```"


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    text: str
    source: str  # the passage's or function's key


@dataclass(frozen=True)
class PromptSplit:
    train: list[Prompt]
    held_out: list[Prompt]


def build_prompts(corpus_dir: Path, seed: int, held_out_per_kind: int, stdlib: Path | None = None) -> PromptSplit:
    """All training prompts (kinds interleaved) and `held_out_per_kind` held-out prompts of each kind."""
    rng = random.Random(seed)
    pools: dict[bool, dict[str, list[Prompt]]] = {held: {kind: [] for kind in KINDS} for held in (False, True)}
    for passage in prose_passages(corpus_dir):
        prompt = _prose_prompt(passage, rng)
        pools[_held_out(seed, passage.key)][prompt.kind].append(prompt)
    for function in stdlib_functions(stdlib):
        prompt = _code_prompt(function, rng)
        pools[_held_out(seed, function.key)][prompt.kind].append(prompt)
    for by_kind in pools.values():
        for prompts in by_kind.values():
            rng.shuffle(prompts)
    held_out = [p for kind in KINDS for p in pools[True][kind][:held_out_per_kind]]
    return PromptSplit(_interleave([pools[False][kind] for kind in KINDS]), held_out)


def _held_out(seed: int, key: str) -> bool:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def _prose_prompt(passage: Passage, rng: random.Random) -> Prompt:
    if rng.random() < 0.5:
        return Prompt("instruction", rng.choice(INSTRUCTIONS).format(passage.text), passage.key)
    return Prompt("prose", rng.choice(CONTINUATIONS).format(passage.text), passage.key)


def _code_prompt(function: Function, rng: random.Random) -> Prompt:
    roll = rng.random()
    if roll < 0.25:
        text = f"Explain what the following Python function does.\n\n{FENCE}python\n{function.source}\n{FENCE}"
        return Prompt("instruction", text, function.key)
    if roll < 0.6:
        lines = function.source.splitlines()
        head = "\n".join(lines[: max(2, len(lines) // 2)])
        text = f"Complete the following Python code.\n\n{FENCE}python\n{head}\n{FENCE}"
        return Prompt("code", text, function.key)
    what = "method" if function.signature.split("(", 1)[1].startswith(("self", "cls")) else "function"
    text = f"Write a Python {what} `{function.signature}`. What it does: {function.summary}"
    return Prompt("code", text, function.key)


def _interleave(lists: list[list[Prompt]]) -> list[Prompt]:
    """Round-robin over the kinds, so any prefix of the training prompts keeps them balanced."""
    out: list[Prompt] = []
    for index in range(max(len(items) for items in lists)):
        out += [items[index] for items in lists if index < len(items)]
    return out


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in prompts))


def read_prompts(path: Path) -> list[Prompt]:
    return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


class ChatRenderer:
    """Prompt text -> token ids as the target reads a user turn: its chat template when it has one,
    ChatML when its vocabulary has <|im_start|>, else the text as it is."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.chatml = tokenizer.token_to_id("<|im_start|>") is not None

    def text(self, prompt: str) -> str:
        if self.template:
            return render_chat(self.template, [{"role": "user", "content": prompt}])
        if self.chatml:
            return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        return prompt

    def __call__(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(self.text(prompt), add_special_tokens=False).ids
