"""The wheel the images build (`pip wheel .`) holds every package of the source tree: pyproject.toml lists them one
by one, and executor_service.parallel was once missing from the list (tensor parallelism failed to import in the
images while every test, run from the checkout, passed). A new top-level package must be listed too, and each image
must have it in its build context (.dockerignore) and COPY it in: setuptools refuses a listed package it cannot
find, so one left out of an image fails that image's build (gateway_service was once left out of .dockerignore)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"specdec": REPO / "protos" / "specdec"}
DOCKERFILES = ("deploy/selector.Dockerfile", "deploy/executor.Dockerfile", "deploy/gateway.Dockerfile")


def source_packages(listed: list[str]) -> set[str]:
    """Every folder with an __init__.py under the listed top-level packages, as dotted names."""
    found = set()
    for top in {name.split(".")[0] for name in listed}:
        root = PACKAGE_DIRS.get(top, REPO / top)
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((top, *parts)))
    return found


def unlisted_top_level(root: Path, listed: list[str]) -> list[str]:
    """Top-level folders of `root` with an __init__.py that the list leaves out."""
    tops = {name.split(".")[0] for name in listed}
    return sorted(path.parent.name for path in root.glob("*/__init__.py") if path.parent.name not in tops)


def package_folders(listed: list[str]) -> set[str]:
    """The folders, relative to the repository, that hold the listed top-level packages."""
    tops = {name.split(".")[0] for name in listed}
    return {PACKAGE_DIRS.get(top, REPO / top).relative_to(REPO).as_posix() for top in tops}


def missing_from_image(dockerfile: str, dockerignore: str, folders: set[str]) -> list[str]:
    """'folder (why)' for each package folder a Dockerfile does not COPY, or that .dockerignore leaves out of the
    build context (it ignores everything, `*`, then lets `!folder/` back in)."""
    copied = {line.split()[1].rstrip("/") for line in dockerfile.splitlines() if re.match(r"COPY\s+[^-]", line)}
    allowed = {line[1:].strip().rstrip("/") for line in dockerignore.splitlines() if line.startswith("!")}
    missing = [f"{folder} (not copied)" for folder in sorted(folders - copied)]
    return missing + [f"{folder} (not in .dockerignore)" for folder in sorted(folders - allowed)]


def listed_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["packages"]


def test_every_source_package_is_listed_for_the_wheel() -> None:
    listed = listed_packages()
    assert sorted(source_packages(listed) - set(listed)) == []
    assert unlisted_top_level(REPO, listed) == []


def test_the_check_finds_a_package_left_out() -> None:
    """Negative control: without executor_service.parallel in the list, the check names it; without
    specdec_training, a top-level package, too."""
    listed = [name for name in listed_packages() if name != "executor_service.parallel"]
    assert "executor_service.parallel" in source_packages(listed) - set(listed)
    listed = [name for name in listed_packages() if name != "specdec_training"]
    assert unlisted_top_level(REPO, listed) == ["specdec_training"]


def test_every_image_builds_the_wheel_from_every_listed_package() -> None:
    folders = package_folders(listed_packages())
    assert "protos/specdec" in folders and "specdec_training" in folders
    dockerignore = (REPO / ".dockerignore").read_text()
    for dockerfile in DOCKERFILES:
        assert missing_from_image((REPO / dockerfile).read_text(), dockerignore, folders) == [], dockerfile


def test_the_image_check_finds_a_package_left_out() -> None:
    """Negative control: a folder not copied and one not let back into the build context are both named."""
    dockerfile = "FROM python\nCOPY --from=builder /x /x\nCOPY kernels kernels\nCOPY protos/specdec protos/specdec\n"
    dockerignore = "*\n!kernels/\n!selection/\n"
    assert missing_from_image(dockerfile, dockerignore, {"kernels", "protos/specdec", "selection"}) == [
        "selection (not copied)",
        "protos/specdec (not in .dockerignore)",
    ]
