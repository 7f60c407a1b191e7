"""Stop strings on their own (no engine): StreamedOutput against a reference computed from the whole text,
for stops inside a run of tokens, spanning tokens, starting inside a token or inside a split UTF-8 character;
held-back text; the incremental detokenizer against a full decode."""

from __future__ import annotations

import random

import pytest
from toy_model import ALPHABET, token_text, toy_tokenizer

from executor_service.models.detokenizer import IncrementalDetokenizer
from executor_service.server.stop_strings import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    StreamedOutput,
    stop_violations,
)

tokenizers = pytest.importorskip("tokenizers")


def byte_tokenizer() -> object:
    """Byte-level BPE with one token per byte: every character past ASCII is split across tokens."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


def stream(tokenizer: object, ids: list[int], stop: list[str], runs: list[int]) -> tuple[list[int], str, list[str]]:
    """Feed `ids` in runs of the given lengths (the last run final); the tokens and text released, and the
    text released after each run."""
    output, tokens, texts, start = StreamedOutput(tokenizer, stop), [], [], 0
    for index, length in enumerate(runs):
        released = output.add(ids[start : start + length], final=index == len(runs) - 1)
        start += length
        tokens += released.token_ids
        texts.append(released.text)
    return tokens, "".join(texts), texts


def chars(text: str) -> list[int]:
    """The toy tokenizer's single-character ids for `text`."""
    return [ALPHABET.index(c) for c in text]


def reference(pieces: list[str], stop: list[str]) -> tuple[int, str]:
    """Tokens kept and text shown: the text before the first stop string, and the tokens that end at or
    before its start (all of them and all the text without a match)."""
    text = "".join(pieces)
    found = [text.find(s) for s in stop if s in text]
    if not found:
        return len(pieces), text
    at, end, kept = min(found), 0, 0
    for piece in pieces:
        end += len(piece)
        if end > at:
            break
        kept += 1
    return kept, text[:at]


def test_a_stop_inside_a_run_of_tokens_cuts_text_and_tokens() -> None:
    tokenizer = toy_tokenizer()
    ids = chars("Hello world and more")
    tokens, text, _ = stream(tokenizer, ids, ["o w"], [1, 8, len(ids) - 9])  # 'o w' starts inside the run of 8
    assert text == "Hell" and tokens == ids[:4]
    # A stop that starts inside a two-character token: the token is not streamed, its head is.
    ids = [ALPHABET.index("a"), 64 + ALPHABET.index("b") * 64 + ALPHABET.index("c"), ALPHABET.index("d")]
    assert "".join(token_text(i) for i in ids) == "abcd"
    tokens, text, _ = stream(tokenizer, ids, ["cd"], [3])
    assert (tokens, text) == (ids[:1], "ab")


def test_text_that_may_start_a_stop_is_held_until_decided() -> None:
    tokenizer = toy_tokenizer()
    ids = chars("abcabd")
    tokens, text, texts = stream(tokenizer, ids, ["abd", "xyz"], [1] * len(ids))
    assert text == "abc" and tokens == ids[:3]
    assert texts[:4] == ["", "", "abc", ""]  # 'a', 'ab' held (could start 'abd'); 'abc' is not; 'a' held again
    tokens, text, texts = stream(tokenizer, chars("abab"), ["abd"], [1, 1, 1, 1])
    assert texts == ["", "", "ab", "ab"] and text == "abab"  # the end releases what was held


def test_a_stop_in_a_split_character_never_shows_its_bytes() -> None:
    tokenizer = byte_tokenizer()
    text = "naïve 日本語 🙂🚀 done"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text)  # characters past ASCII take several tokens
    for stop in ["🚀", "本", " done", "ï"]:
        tokens, shown, _ = stream(tokenizer, ids, [stop], [3] * (len(ids) // 3) + [len(ids) % 3])
        assert shown == text[: text.find(stop)]
        assert tokenizer.decode(tokens) == shown  # a stop at a character's first byte: the tokens end there


def test_random_runs_and_stops_match_the_reference() -> None:
    tokenizer, rng = toy_tokenizer(), random.Random(5)
    for _ in range(300):
        ids = [rng.randrange(8) if rng.random() < 0.7 else rng.randrange(512) for _ in range(rng.randrange(1, 30))]
        pieces = [token_text(i) for i in ids]
        text = "".join(pieces)
        start = rng.randrange(len(text))
        stop = [text[start : start + rng.randrange(1, 5)], "".join(rng.choice("abcdefgh") for _ in range(3))]
        runs, left = [], len(ids)
        while left:
            runs.append(min(left, rng.randrange(1, 6)))
            left -= runs[-1]
        tokens, shown, _ = stream(tokenizer, ids, stop, runs)
        kept, expected = reference(pieces, stop)
        assert (tokens, shown) == (ids[:kept], expected), (ids, stop, runs)


def test_without_stops_tokens_go_out_at_once_and_extras_follow_them() -> None:
    output = StreamedOutput(byte_tokenizer(), [])
    ids = byte_tokenizer().encode("é").ids  # two bytes: the first token alone is half a character
    first = output.add(ids[:1], final=False, extras=["lp0"])
    assert (first.token_ids, first.extras, first.text) == (ids[:1], ["lp0"], "")
    assert output.add(ids[1:], final=True, extras=["lp1"]).text == "é"
    held = StreamedOutput(toy_tokenizer(), ["zz"])
    assert held.add([ALPHABET.index("z")], final=False, extras=["lp"]).extras == []
    assert held.add([ALPHABET.index("a")], final=False, extras=["lp2"]).extras == ["lp", "lp2"]
    blind = StreamedOutput(None)
    assert blind.add([1, 2], final=True).token_ids == [1, 2]


def test_the_incremental_detokenizer_matches_a_full_decode() -> None:
    tokenizer = byte_tokenizer()
    text = "mixed ASCII, ümlauts, 漢字 and emoji 🙂 at the end 🚀"
    ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.add(ids[i : i + 2]) for i in range(0, len(ids), 2)) + detokenizer.add([], True)
    assert streamed == text == tokenizer.decode(ids)
    assert detokenizer.ends[-1] == len(text) and detokenizer.ends == sorted(detokenizer.ends)


def test_stop_bounds() -> None:
    assert stop_violations(["a"] * MAX_STOP_STRINGS) == []
    assert [v.field for v in stop_violations(["a"] * (MAX_STOP_STRINGS + 1))] == ["sampling.stop"]
    found = stop_violations(["ok", "", "x" * (MAX_STOP_STRING_CHARS + 1)])
    assert [v.field for v in found] == ["sampling.stop[1]", "sampling.stop[2]"]
