"""The wheel the images build (`pip wheel .`) holds every package of the source tree: pyproject.toml lists them one
by one, and executor_service.parallel was once missing from the list (tensor parallelism failed to import in the
images while every test, run from the checkout, passed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"specdec": REPO / "protos" / "specdec"}


def source_packages(listed: list[str]) -> set[str]:
    """Every folder with an __init__.py under the listed top-level packages, as dotted names."""
    found = set()
    for top in {name.split(".")[0] for name in listed}:
        root = PACKAGE_DIRS.get(top, REPO / top)
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((top, *parts)))
    return found


def listed_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["packages"]


def test_every_source_package_is_listed_for_the_wheel() -> None:
    listed = listed_packages()
    assert sorted(source_packages(listed) - set(listed)) == []


def test_the_check_finds_a_package_left_out() -> None:
    """Negative control: without executor_service.parallel in the list, the check names it."""
    listed = [name for name in listed_packages() if name != "executor_service.parallel"]
    assert "executor_service.parallel" in source_packages(listed) - set(listed)
