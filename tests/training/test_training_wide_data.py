"""More offline training text: duplicates dropped, nothing shared with held-out prompts even under another
key, conversations marked, system docs read once per paragraph, and token ids stored as uint16 (int32 for
larger vocabularies) that read back unchanged."""

from __future__ import annotations

import base64
import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specdec_training.corpus import Passage, prose_passages, stdlib_functions
from specdec_training.datagen import read_sequences, sequence_row, token_dtype
from specdec_training.prompts import Material, build_prompts, prompt_counts, read_prompts, write_prompts
from specdec_training.system_docs import system_doc_passages


def test_copies_under_new_keys_are_duplicates_or_refused_as_held_out(corpus: Path, stdlib: Path) -> None:
    plain = build_prompts(corpus, 0, 2, stdlib)
    held_sources = {p.source for p in plain.held_out}
    functions = [replace(f, key=f"site:{f.key}") for f in stdlib_functions(stdlib)]
    passages = [replace(p, key=f"sysdoc:{p.key}") for p in prose_passages(corpus)]
    quoted = next(p for p in prose_passages(corpus) if p.key in held_sources)
    passages.append(Passage("sysdoc:quote:0", "As the book says: " + quoted.text))
    wide = build_prompts(corpus, 0, 2, stdlib, Material(functions, passages))
    assert wide.held_out == plain.held_out  # extra material never changes the held-out prompts
    copies = {f"site:{k}" for k in held_sources} | {f"sysdoc:{k}" for k in held_sources} | {"sysdoc:quote:0"}
    assert not copies & {p.source for p in wide.train}
    assert wide.dropped["shares held-out text"] >= 1 and wide.dropped["duplicate"] >= len(plain.train) // 2
    assert len({p.text for p in wide.train}) == len(wide.train)


def test_conversations_are_marked_and_survive_the_file(corpus: Path, stdlib: Path, tmp_path: Path) -> None:
    split = build_prompts(corpus, 0, 2, stdlib)
    counts = prompt_counts(split.train)
    assert set(counts["turns"]) == {"1", "2", "3"} and sum(counts["kind"].values()) == len(split.train)
    assert {"kjv", "stdlib functions"} <= set(counts["source"])
    write_prompts(tmp_path / "p.jsonl", split.train)
    assert read_prompts(tmp_path / "p.jsonl") == split.train
    held_out = Path("drafters/prompts_heldout.jsonl").read_text().splitlines()
    assert all("followups" not in json.loads(line) for line in held_out)


def test_system_docs_skip_change_logs_and_read_a_paragraph_once(tmp_path: Path) -> None:
    words = "the quick brown fox jumps over the lazy dog again and again {} times"
    text = "\n\n".join(words.format(i) + "\nand keeps going" for i in range(40))
    (tmp_path / "doc" / "a").mkdir(parents=True)
    (tmp_path / "doc" / "b").mkdir(parents=True)
    (tmp_path / "doc" / "a" / "README").write_text(text)
    (tmp_path / "doc" / "b" / "README.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "doc" / "a" / "changelog.gz").write_bytes(gzip.compress(text.upper().encode()))
    passages = [p for p in system_doc_passages((tmp_path / "doc",)) if p.key.startswith("sysdoc:")]
    assert passages and all(p.key.startswith("sysdoc:doc/a/README:") for p in passages)
    assert "and keeps going" in passages[0].text and "\n" not in passages[0].text.split("\n\n")[0]


@pytest.mark.parametrize(("vocab", "dtype"), [(49152, "<u2"), (65536, "<u2"), (151936, "<i4")])
def test_token_ids_round_trip_compactly(vocab: int, dtype: str, tmp_path: Path) -> None:
    assert token_dtype(vocab).str == dtype
    prompt, response = [0, 1, vocab - 1, 7], [vocab - 2, 0, 3] * 50
    path = tmp_path / "data.jsonl"
    row = sequence_row(0, "code", prompt, response, vocab)
    legacy = {"index": 1, "kind": "prose", "prompt": [5, 6], "response": [7]}
    path.write_text(json.dumps(row) + "\n" + json.dumps(legacy) + "\n")
    back = read_sequences(path)
    assert (back[0].prompt, back[0].response, back[0].kind) == (prompt, response, "code")
    assert (back[1].prompt, back[1].response) == ([5, 6], [7])
    assert len(base64.b64decode(row["response"])) == np.dtype(dtype).itemsize * len(response)  # 2 or 4 bytes an id
    with pytest.raises(ValueError, match="out of range"):
        sequence_row(0, "code", [-1], [], vocab)
