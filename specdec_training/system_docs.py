"""Documentation text installed on the machine, cut into passages: Debian's /usr/share/doc (READMEs, NEWS,
copyright notices), the licenses in /usr/share/common-licenses, GNU info manuals, and the Python
language reference that ships inside the stdlib (pydoc_data.topics).

Change logs, source files and HTML are skipped; a paragraph already seen in another file (the same
license text is in hundreds of copyright files) is read once.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

from specdec_training.corpus import Passage, _chunk, _readable

DOC_ROOTS = (Path("/usr/share/doc"), Path("/usr/share/common-licenses"), Path("/usr/share/info"))
NAMES = re.compile(
    r"^(readme|news|copyright|todo|faq|authors|thanks|bugs|usage|intro)|\.(txt|md|rst|info)(-\d+)?$", re.I
)
SKIPPED = re.compile(r"changelog|\.(html?|py|go|c|h|js|css|xml|json|ya?ml|sh|pl)$", re.I)
MAX_FILE_BYTES = 4_000_000
DEBIAN_FIELDS = re.compile(r"(Files|Copyright|Format|Upstream-[\w-]+|Source|Comment):")


def system_doc_passages(roots: tuple[Path, ...] = DOC_ROOTS) -> list[Passage]:
    """Passages of the readable documentation under `roots` (missing roots are skipped), in path order."""
    seen: set[bytes] = set()
    passages: list[Passage] = []
    for root in roots:
        for path in _doc_files(root):
            text = _read(path)
            if text is None:
                continue
            paragraphs = []
            for paragraph in _paragraphs(text):
                digest = hashlib.blake2b(" ".join(paragraph.lower().split()).encode(), digest_size=8).digest()
                if digest not in seen:
                    seen.add(digest)
                    paragraphs.append(paragraph)
            passages += _chunk(f"sysdoc:{path.relative_to(root.parent)}", paragraphs)
    passages += pydoc_topic_passages()
    return passages


def pydoc_topic_passages() -> list[Passage]:
    """The language reference's topics (what `help('if')` shows), from the running Python."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    passages: list[Passage] = []
    for name in sorted(topics):
        passages += _chunk(f"pydoc:{name}", list(_paragraphs(topics[name])))
    return passages


def _doc_files(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        return
    for path in sorted(root.rglob("*")):
        name = path.name.removesuffix(".gz")
        if path.is_file() and not path.is_symlink() and NAMES.search(name) and not SKIPPED.search(name):
            yield path
    if root.name == "common-licenses":
        licenses = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink())
        yield from (p for p in licenses if not NAMES.search(p.name))


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\0" in data[:4096]:
        return None
    return data.decode("utf-8", errors="replace")


def _paragraphs(text: str) -> Iterator[str]:
    """Reflowed paragraphs that read as prose: mostly letters, a few words at least, no markup debris."""
    for block in re.split(r"\n\s*\n|\x1f", text):
        lines = [line.strip() for line in block.strip().splitlines()]
        paragraph = " ".join(line for line in lines if line)
        letters = sum(c.isalpha() or c == " " for c in paragraph)
        fields = DEBIAN_FIELDS.match(paragraph)  # machine-readable copyright headers: file lists, not prose
        if len(paragraph.split()) >= 8 and letters >= 0.8 * len(paragraph) and _readable(paragraph) and not fields:
            yield paragraph
