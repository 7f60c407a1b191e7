"""Prompts of three kinds from the corpus, a held-out split, and their rendering for the target.

- instruction: summarize / explain / question a prose passage, or explain a standard-library function;
- prose: continue a passage;
- code: write a function from its signature and docstring summary, or complete its opening lines.

Every passage or function lands in the held-out pool or the training pool by a hash of (seed, its key),
so the two never share text, and the held-out prompts (the acceptance benchmark's) depend only on the
corpus and the seed, not on how many training prompts are asked for.

Training prompts can also come from more offline material (`Material`: installed packages' functions
and docstrings, the stdlib's docstrings, system documentation). It never feeds the held-out prompts,
so those stay what they were; its held-out share by key is left unused, every candidate is checked
against the held-out text itself (separation.py), and duplicates by normalized text are dropped. A
share of the training prompts become conversations: `followups` are later user turns, answered in turn
by the target when the data is generated.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from executor_service.models.gguf_tokenizer import render_chat
from specdec_training.corpus import Function, Passage, prose_passages, python_sources, stdlib_functions
from specdec_training.separation import HeldOutGuard, function_request, normalized_hash
from specdec_training.system_docs import system_doc_passages

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
DOC_INSTRUCTIONS = (
    "Summarize the following documentation in a few sentences.\n\n{}",
    "Explain this passage from the documentation to a newcomer.\n\n{}",
    "What does the following text say? Answer in a short list.\n\n{}",
    "Write three questions a reader might ask about this text, then answer them.\n\n{}",
)
FOLLOWUPS = {
    "instruction": (
        "Can you say that more briefly?",
        "Give an example that illustrates it.",
        "What is the most important point, and why?",
        "Now explain it to a child.",
    ),
    "prose": ("Continue from where you stopped.", "Now summarize what you wrote.", "Rewrite your text as a poem."),
    "code": (
        "Now write a short test for it.",
        "Explain how your code works, step by step.",
        "How could this be made faster or simpler?",
        "Add type hints and a docstring.",
    ),
}
MULTI_TURN_SHARE = 0.2  # of the training prompts, with one or two follow-up user turns
FENCE = "```"


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    text: str
    source: str  # the passage's or function's key
    followups: tuple[str, ...] = ()  # later user turns of a conversation; the target answers each in turn


@dataclass(frozen=True)
class PromptSplit:
    train: list[Prompt]
    held_out: list[Prompt]
    dropped: dict[str, int]  # training candidates left out: "duplicate", "shares held-out text"


@dataclass(frozen=True)
class Material:
    """Offline text beyond the corpus; training only."""

    functions: list[Function]
    passages: list[Passage]


def build_prompts(
    corpus_dir: Path,
    seed: int,
    held_out_per_kind: int,
    stdlib: Path | None = None,
    material: Material | None = None,
    exclude: list[Prompt] = (),  # type: ignore[assignment]
) -> PromptSplit:
    """All training prompts (kinds interleaved) and `held_out_per_kind` held-out prompts of each kind.
    No training prompt shares text with those, nor with `exclude` (e.g. an earlier held-out file)."""
    rng = random.Random(seed)
    Candidate = tuple[Prompt, tuple[str, bytes | None]]  # with the text it was made from, for the checks
    pools: dict[bool, dict[str, list[Candidate]]] = {held: {kind: [] for kind in KINDS} for held in (False, True)}
    for passage in prose_passages(corpus_dir):
        prompt = _prose_prompt(passage, rng)
        pools[_held_out(seed, passage.key)][prompt.kind].append((prompt, (passage.text, None)))
    for function in stdlib_functions(stdlib):
        prompt = _code_prompt(function, rng)
        request = function_request(function.signature, function.summary)
        pools[_held_out(seed, function.key)][prompt.kind].append((prompt, (function.source, request)))
    for by_kind in pools.values():
        for prompts in by_kind.values():
            rng.shuffle(prompts)
    held_out = [p for kind in KINDS for p, _ in pools[True][kind][:held_out_per_kind]]
    extra = random.Random(f"{seed}:extra")
    legacy = sum(len(pools[False][kind]) for kind in KINDS)  # split by key already; the material is checked
    candidates = [candidate for kind in KINDS for candidate in pools[False][kind]]
    if material is not None:
        for passage in material.passages:
            if not _held_out(seed, passage.key):
                candidates.append((_doc_prompt(passage, extra), (passage.text, None)))
        for function in material.functions:
            if not _held_out(seed, function.key):
                request = function_request(function.signature, function.summary)
                candidates.append((_code_prompt(function, extra), (function.source, request)))
    guard = HeldOutGuard((p.source, p.text) for p in [*held_out, *exclude])
    train: dict[str, list[Prompt]] = {kind: [] for kind in KINDS}
    seen: set[bytes] = set()
    dropped = {"duplicate": 0, "shares held-out text": 0}
    for position, (prompt, (text, request)) in enumerate(candidates):
        digest = normalized_hash(text)
        if digest in seen or request in seen:
            dropped["duplicate"] += 1
        elif (position >= legacy or exclude) and guard.shares(prompt.source, text, request):
            dropped["shares held-out text"] += 1
        else:
            seen.update((digest, request) if request else (digest,))
            train[prompt.kind].append(_with_followups(prompt, extra))
    if material is not None:
        for prompts in train.values():
            extra.shuffle(prompts)
    return PromptSplit(_interleave([train[kind] for kind in KINDS]), held_out, dropped)


def _with_followups(prompt: Prompt, rng: random.Random) -> Prompt:
    if rng.random() >= MULTI_TURN_SHARE:
        return prompt
    return replace(prompt, followups=tuple(rng.sample(FOLLOWUPS[prompt.kind], rng.randint(1, 2))))


def _held_out(seed: int, key: str) -> bool:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def _prose_prompt(passage: Passage, rng: random.Random) -> Prompt:
    if rng.random() < 0.5:
        return Prompt("instruction", rng.choice(INSTRUCTIONS).format(passage.text), passage.key)
    return Prompt("prose", rng.choice(CONTINUATIONS).format(passage.text), passage.key)


def _doc_prompt(passage: Passage, rng: random.Random) -> Prompt:
    if rng.random() < 0.6:
        return Prompt("instruction", rng.choice(DOC_INSTRUCTIONS).format(passage.text), passage.key)
    return Prompt("prose", rng.choice(CONTINUATIONS[:1] + CONTINUATIONS[2:]).format(passage.text), passage.key)


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
    """JSONL; `followups` only where there are some, so single-turn files read as they always did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in asdict(p).items() if k != "followups" or v} for p in prompts]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def read_prompts(path: Path) -> list[Prompt]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Prompt(**{**row, "followups": tuple(row.get("followups", ()))}) for row in rows]


def source_family(key: str) -> str:
    """The source a prompt's key comes from, for counts: kjv, shakespeare, stdlib, packages, ..."""
    head = key.split(":", 1)[0]
    if head in ("kjv", "sysdoc", "pydoc"):
        return head
    if head == "doc":
        return "package docstrings" if key.startswith("doc:site:") else "stdlib docstrings"
    if head == "site":
        return "package functions"
    return "stdlib functions" if key.count(":") >= 2 else "shakespeare"


def prompt_counts(prompts: list[Prompt]) -> dict[str, dict[str, int]]:
    """How many prompts of each kind, from each source, and with how many user turns."""
    counts: dict[str, dict[str, int]] = {"kind": {}, "source": {}, "turns": {}}
    for prompt in prompts:
        for table, name in (("kind", prompt.kind), ("source", source_family(prompt.source))):
            counts[table][name] = counts[table].get(name, 0) + 1
        turns = str(1 + len(prompt.followups))
        counts["turns"][turns] = counts["turns"].get(turns, 0) + 1
    return counts


class ChatRenderer:
    """Prompt text -> token ids as the target reads a user turn: its chat template when it has one,
    ChatML when its vocabulary has <|im_start|>, else the text as it is."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.chatml = tokenizer.token_to_id("<|im_start|>") is not None

    def text(self, prompt: str) -> str:
        return self.conversation([{"role": "user", "content": prompt}])

    def conversation(self, messages: list[dict[str, str]]) -> str:
        """A conversation ending in a user turn, with the assistant's turn opened."""
        if self.template:
            return render_chat(self.template, messages)
        if self.chatml:
            turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return f"{turns}<|im_start|>assistant\n"
        return "\n\n".join(m["content"] for m in messages)

    def __call__(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(self.text(prompt), add_special_tokens=False).ids

    def messages(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.conversation(messages), add_special_tokens=False).ids


MATERIAL_SOURCES = ("packages", "stdlib-docs", "system-docs")


def offline_material(sources: tuple[str, ...] = MATERIAL_SOURCES) -> Material:
    """More training text from this machine: "packages" (the running environment's site-packages:
    functions and docstrings), "stdlib-docs" (the stdlib's module and class docstrings), "system-docs"
    (/usr/share/doc, common-licenses, info manuals, the language reference)."""
    unknown = set(sources) - set(MATERIAL_SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose from {', '.join(MATERIAL_SOURCES)}")
    functions: list[Function] = []
    passages: list[Passage] = []
    if "packages" in sources:
        found = python_sources(Path(sysconfig.get_paths()["purelib"]), "site:")
        functions, passages = found[0], [replace(p, key=f"doc:{p.key.removeprefix('doc:')}") for p in found[1]]
    if "stdlib-docs" in sources:
        passages += python_sources(Path(sysconfig.get_paths()["stdlib"]))[1]
    if "system-docs" in sources:
        passages += system_doc_passages()
    return Material(functions, passages)
