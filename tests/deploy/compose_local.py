"""docker-compose.yml read the way compose reads it, then mapped onto this machine, so that a test can run a
service's real command without a Docker engine (imported as `compose_local`: pytest puts this folder on sys.path).

What compose would do, done here: `${VAR}`, `${VAR:-default}`, `${VAR-default}` and `$$` substitution; YAML
merge keys; the image's ENTRYPOINT and ENV (from the service's Dockerfile) followed by the service's `command`
and `environment`. What a container would give, mapped: a console script on the image's PATH is the one next
to this interpreter, `python` is this interpreter, a file the Dockerfile COPYs in is the repository's file, a
bind-mounted container path is its host path, and `<service>:<port>` is the local address of that service.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?-)([^}]*))?\})")
# Set by the image for the container only: the venv's PATH means nothing here.
CONTAINER_ONLY_ENV = {"PATH"}


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """Compose's variable substitution over strings inside any YAML value."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        escaped, name, operator, default = match.groups()
        if escaped:
            return "$"
        current = variables.get(name)
        if (operator == ":-" and not current) or (operator == "-" and current is None):
            return default
        return current or ""

    return VARIABLE.sub(substitute, value)


def variable_defaults(text: str) -> dict[str, str]:
    """Every `${VAR:-default}` of a compose file's text: the variables it reads and what they default to."""
    return {name: default for _, name, operator, default in VARIABLE.findall(text) if name and operator == ":-"}


def load_compose(variables: Mapping[str, str], path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The compose file with variables substituted (extension fields x-* dropped, as compose does)."""
    raw = yaml.safe_load(path.read_text())
    return {key: interpolate(value, variables) for key, value in raw.items() if not key.startswith("x-")}


@dataclass(frozen=True)
class Image:
    """What a Dockerfile's final stage gives a container: ENTRYPOINT, ENV and the files COPYed from the context."""

    entrypoint: list[str]
    env: dict[str, str]
    copies: dict[str, Path]  # container path -> repository path


def read_dockerfile(path: Path) -> Image:
    text = re.sub(r"\\\n", " ", path.read_text())
    stage = re.split(r"^FROM\s", text, flags=re.MULTILINE)[-1].splitlines()
    entrypoint: list[str] = []
    env: dict[str, str] = {}
    copies: dict[str, Path] = {}
    for line in stage:
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "ENTRYPOINT":
            entrypoint = yaml.safe_load(rest)  # the exec form is a JSON list
        elif instruction == "ENV":
            env.update(pair.split("=", 1) for pair in shlex.split(rest))  # type: ignore[misc]
        elif instruction == "COPY" and not rest.startswith("--"):
            source, destination = shlex.split(rest)
            copies[destination] = REPO_ROOT / source
    if not entrypoint:
        raise ValueError(f"{path}: no exec-form ENTRYPOINT in the final stage")
    return Image(entrypoint, env, copies)


@dataclass
class LocalService:
    """A compose service as a local process: its argv, environment and health-check argv."""

    name: str
    config: dict[str, Any]
    image: Image
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str]

    @property
    def container_port(self) -> int:
        return int(self.env["SPECDEC_PORT"])


def to_local(word: str, image: Image, mounts: Mapping[str, str], addresses: Mapping[str, str]) -> str:
    """One word of a command or an environment value, as this machine needs it."""
    if word in image.copies:
        return str(image.copies[word])
    for container_path, host_path in mounts.items():
        if word == container_path or word.startswith(container_path + "/"):
            return host_path + word[len(container_path) :]
    return addresses.get(word, word)


def executable(name: str) -> str:
    """A program the image runs by name: `python`, or a console script installed with the project."""
    if name in ("python", "python3"):
        return sys.executable
    script = Path(sys.executable).parent / name
    if not script.exists():
        raise FileNotFoundError(f"{script}: the image runs {name!r}; install the project (pip install -e .)")
    return str(script)


def local_service(
    compose: dict[str, Any], name: str, overrides: Mapping[str, str], addresses: Mapping[str, str]
) -> LocalService:
    """Service `name` of a loaded compose file, with `overrides` laid over its environment (the local ports) and
    `addresses` ("selector:50051" -> "127.0.0.1:PORT") standing in for the compose network's names."""
    config = compose["services"][name]
    image = read_dockerfile(REPO_ROOT / config["build"]["context"] / config["build"]["dockerfile"])
    mounts = {}
    for volume in config.get("volumes", []):
        host, container, *_ = volume.split(":")
        mounts[container] = str((REPO_ROOT / host).resolve())
    declared = {**image.env, **{key: str(value) for key, value in config.get("environment", {}).items()}}
    declared = {key: value for key, value in declared.items() if key not in CONTAINER_ONLY_ENV}
    env = {key: to_local(value, image, mounts, addresses) for key, value in {**declared, **overrides}.items()}
    command = [*config.get("entrypoint", image.entrypoint), *config.get("command", [])]
    argv = [executable(command[0]), *(to_local(word, image, mounts, addresses) for word in command[1:])]
    test = config["healthcheck"]["test"]
    if test[0] != "CMD":
        raise ValueError(f"{name}: healthcheck.test must use the exec form ['CMD', ...], not {test[0]!r}")
    probe = [executable(test[1]), *(to_local(word, image, mounts, addresses) for word in test[2:])]
    return LocalService(name, config, image, argv, env, probe)


def process_env(service: LocalService) -> dict[str, str]:
    """This process's environment without any SPECDEC_* of its own, plus the service's."""
    base = {key: value for key, value in os.environ.items() if not key.startswith("SPECDEC_")}
    return {**base, **service.env}
