"""The documentation against the tree: README.md stays a short user's guide with the two commands, every relative
link in the Markdown files resolves (files and #anchors), docs/executor.md's code layout lists every module of
executor_service/ once (docs/training.md's, of specdec_training/), and the selection rules are numbered as
docs/selection.md numbers them.

Each check is a function over text and a folder, so the negative controls below feed it made-up input.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# The README's two commands: one installs and runs the main job, one installs and runs the tests.
README_COMMANDS = ("bash scripts/run.sh", "bash scripts/test.sh")
SKIPPED_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache", "results"}


def repo_files(root: Path, suffixes: set[str]) -> list[Path]:
    """The repository's own files with these suffixes (no virtual environment, node_modules or bench results)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        found += [Path(folder) / name for name in files if Path(name).suffix in suffixes]
    return sorted(found)


def markdown_files(root: Path) -> list[Path]:
    return repo_files(root, {".md"})


# ---- links --------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a link-looking string inside one is code, not a link). A block closes
    at a fence of the same character, at least as long, with nothing after it (CommonMark), so a ```` block may hold
    ``` lines."""
    kept: list[str] = []
    fence = ""
    for line in text.splitlines():
        match = FENCE.match(line)
        if not fence:
            if match:
                fence = match.group(1)
            else:
                kept.append(line)
        elif (
            match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2).strip()
        ):
            fence = ""
    return "\n".join(kept)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown text (lower case, punctuation dropped, spaces to
    hyphens, -1, -2, ... for repeats)."""
    seen: Counter[str] = Counter()
    anchors = set()
    for line in _prose(text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link in a heading keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        anchors.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def broken_links(path: Path, root: Path) -> list[str]:
    """'file: link (why)' for every relative link in `path` whose file or heading anchor is not there."""
    broken = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http:, https:, mailto:
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}: {target}"
        if not resolved.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_every_relative_link_in_the_markdown_files_resolves() -> None:
    files = markdown_files(REPO_ROOT)
    assert REPO_ROOT / "README.md" in files and REPO_ROOT / "docs" / "executor.md" in files
    assert [link for path in files for link in broken_links(path, REPO_ROOT)] == []


def test_the_link_check_sees_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    """Negative control: a link to a missing file and one to a missing heading fail; good ones, web addresses and
    links inside code blocks pass."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The part: in detail (R2)\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#the-part-in-detail-r2) [web](https://example.com/x.md)\n"
        "[gone](docs/b.md) [no anchor](docs/a.md#nowhere)\n```\n[in code](docs/c.md)\n```\n"
        "````\n```python\n[in code too](docs/d.md)\n```\n````\n"
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#nowhere (no heading with that anchor)",
    ]


# ---- README -------------------------------------------------------------------------------------------------------


def readme_problems(text: str) -> list[str]:
    problems = []
    if len(text.splitlines()) > README_MAX_LINES:
        problems.append(f"{len(text.splitlines())} lines, more than {README_MAX_LINES}")
    problems += [f"no `{command}`" for command in README_COMMANDS if command not in text]
    return problems


def test_the_readme_is_a_short_guide_with_the_two_commands() -> None:
    assert readme_problems((REPO_ROOT / "README.md").read_text()) == []


def test_the_readme_check_refuses_a_long_readme_without_its_commands() -> None:
    assert readme_problems("line\n" * (README_MAX_LINES + 1)) == [
        f"{README_MAX_LINES + 1} lines, more than {README_MAX_LINES}",
        "no `bash scripts/run.sh`",
        "no `bash scripts/test.sh`",
    ]


# ---- docs/executor.md's code layout --------------------------------------------------------------------------------

CODE_SPAN = re.compile(r"`([^`\s]+\.py)`")


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a Markdown text, up to the next heading of the same or a higher
    level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def layout_problems(layout: str, package: Path) -> list[str]:
    """What a code-layout list gets wrong about the modules under `package`: every `.py` file (but `__init__.py`)
    must be named once in backticks, by its path inside the package (`engine.py`, `parallel/worker.py`), and every
    name must be there. A name whose first folder is a top-level package of the repository other than one inside
    `package` (`kernels/small_gemm.py`) refers outside and is not counted; so are names with a `*`."""
    modules = {path.relative_to(package).as_posix() for path in package.rglob("*.py") if path.name != "__init__.py"}
    modules = {module for module in modules if "__pycache__" not in module}
    outside = {path.name for path in package.parent.iterdir() if path.is_dir()} - {
        path.name for path in package.iterdir() if path.is_dir()
    }
    listed = Counter(
        name
        for name in CODE_SPAN.findall(layout)
        if "*" not in name and not ("/" in name and name.split("/")[0] in outside)
    )
    problems = [f"{name} is not listed" for name in sorted(modules - set(listed))]
    problems += [f"{name} is listed but not in {package.name}/" for name in sorted(set(listed) - modules)]
    problems += [f"{name} is listed {count} times" for name, count in sorted(listed.items()) if count > 1]
    return problems


def test_the_executor_layout_lists_every_module_once() -> None:
    layout = section((REPO_ROOT / "docs" / "executor.md").read_text(), "Code layout")
    assert layout_problems(layout, REPO_ROOT / "executor_service") == []


def test_the_trainer_layout_lists_every_module_once() -> None:
    layout = section((REPO_ROOT / "docs" / "training.md").read_text(), "Code layout")
    assert layout_problems(layout, REPO_ROOT / "specdec_training") == []


def test_the_layout_check_refuses_a_made_up_list(tmp_path: Path) -> None:
    """Negative control: a missing module, a listed file that is not there and a file listed twice are all
    found; a sub-package's file is named folder/file, and a name in another top-level package is not counted."""
    package = tmp_path / "service"
    (package / "engine").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    for name in ("__init__.py", "main.py", "servicer.py", "engine/__init__.py", "engine/scheduler.py"):
        (package / name).write_text("")
    good = "- `main.py`, `servicer.py`; `engine/scheduler.py` (on `kernels/attention.py`, `kernels/gemm*.py`)"
    assert layout_problems(good, package) == []
    bad = "- `main.py`, `main.py`, `scheduler.py`, `ghost.py`"
    assert layout_problems(bad, package) == [
        "engine/scheduler.py is not listed",
        "servicer.py is not listed",
        "ghost.py is listed but not in service/",
        "scheduler.py is listed but not in service/",
        "main.py is listed 2 times",
    ]


# ---- selection rules ----------------------------------------------------------------------------------------------

RULE_HEADING = re.compile(r"^### R(\d+):", re.MULTILINE)
# "the rules R1-R10", "rules (R1-R11", "R1..R11": a span from the first rule names them all. A subset is written
# out ("R1 to R8", "R1, R2, R3").
RULE_SPAN = re.compile(r"\bR1\s*(?:-|\.\.|\u2013)\s*R(\d+)\b")


def defined_rules(selection_md: str) -> list[int]:
    return [int(number) for number in RULE_HEADING.findall(selection_md)]


def rule_number_problems(texts: dict[str, str], last_rule: int) -> list[str]:
    """'file: what' for every span R1-Rn that stops short of (or beyond) the last rule, and every rule number Rn
    beyond it."""
    problems = []
    for name, text in texts.items():
        for match in RULE_SPAN.finditer(text):
            if int(match.group(1)) != last_rule:
                problems.append(f"{name}: {match.group(0)!r}, the rules are R1-R{last_rule}")
        for number in sorted({int(n) for n in re.findall(r"\(R(\d+)[,;)]", text)}):
            if number > last_rule:
                problems.append(f"{name}: (R{number}), the rules stop at R{last_rule}")
    return problems


def rule_citing_files(root: Path) -> dict[str, str]:
    paths = [path for path in repo_files(root, {".md", ".py", ".proto"}) if path != Path(__file__).resolve()]
    return {path.relative_to(root).as_posix(): path.read_text(errors="replace") for path in paths}


def test_the_selection_rules_are_numbered_as_docs_selection_md_numbers_them() -> None:
    rules = defined_rules((REPO_ROOT / "docs" / "selection.md").read_text())
    assert rules == list(range(1, len(rules) + 1)) and len(rules) >= 11
    assert rule_number_problems(rule_citing_files(REPO_ROOT), rules[-1]) == []


def test_the_rule_check_sees_an_old_span_and_an_unknown_rule() -> None:
    texts = {
        "a.py": '"""The rules R1-R10 (docs/selection.md)."""',
        "b.md": "rules (R1..R8) and (R12)",
        "c.md": "R1-R11 and R1 to R8 of R1-R11; (R2, R11)",
    }
    assert rule_number_problems(texts, 11) == [
        "a.py: 'R1-R10', the rules are R1-R11",
        "b.md: 'R1..R8', the rules are R1-R11",
        "b.md: (R12), the rules stop at R11",
    ]
