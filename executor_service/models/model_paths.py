"""Model paths from a request: a file or directory strictly under --model-root, checked before any file is read.

Anything else (absolute elsewhere, `..`, a link that leaves the root, a NUL byte, an over-long name) is
INVALID_ARGUMENT on the request field that named it.
"""

from __future__ import annotations

from pathlib import Path

from executor_service.errors import FieldProblem, invalid_fields
from executor_service.models.limits import short_repr

MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX


def resolve_model_path(raw: str, model_root: Path | None, field: str) -> Path:
    """A directory strictly under --model-root; anything else (absolute elsewhere, `..`, links out) is refused."""
    if model_root is None:
        raise invalid_fields([FieldProblem(field, "loading from a path is off: start the executor with --model-root")])
    if not raw:
        raise invalid_fields([FieldProblem(field, "required: a directory under the model root")])
    check_path_text(raw, field)
    if ".." in Path(raw).parts:
        raise invalid_fields([FieldProblem(field, "'..' is not allowed in model paths")])
    root = model_root.resolve()
    candidate = resolve_quietly(root / raw, raw, field)  # an absolute `raw` replaces root; links are followed
    if candidate != root and root not in candidate.parents:
        raise invalid_fields([FieldProblem(field, f"{short_repr(raw)} is outside the model root {root_name(root)}")])
    if not _is_dir(candidate):
        problem = f"{short_repr(raw)} is not a directory under the model root {root_name(root)}"
        raise invalid_fields([FieldProblem(field, problem)])
    return candidate


def root_name(root: Path) -> str:
    """The model root as path errors name it, quoted: the caller learns where its paths are looked up (the
    operator's own setting, so not clipped like the caller's input; the status clips the whole text)."""
    return repr(str(root))


def check_model_root(raw: str) -> Path:
    """--model-root at start: an existing directory, or a ValueError naming it (the executor refuses to start,
    rather than refusing every later LoadModel)."""
    root = Path(raw)
    if not _is_dir(root):
        problem = "does not exist" if not root.exists() else "is not a directory"
        raise ValueError(f"--model-root {raw}: {problem}")
    return root


def check_path_text(raw: str, field: str) -> None:
    """What no file system accepts, refused before one is asked: a NUL byte, an over-long path or name."""
    encoded = raw.encode("utf-8", "surrogateescape")
    if "\0" in raw:
        problem = "contains a NUL byte"
    elif len(encoded) > MAX_PATH_BYTES:
        problem = f"is {len(encoded)} bytes long; at most {MAX_PATH_BYTES}"
    elif any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        problem = f"has a name longer than {MAX_NAME_BYTES} bytes"
    else:
        return
    raise invalid_fields([FieldProblem(field, f"{short_repr(raw)} {problem}")])


def resolve_quietly(path: Path, raw: str, field: str) -> Path:
    """`path` with its links followed; a link loop or an unreadable component is INVALID_ARGUMENT on `field`
    (Path.resolve raises RuntimeError for a loop, OSError or ValueError for the rest)."""
    try:
        return path.resolve()
    except RuntimeError:
        problem = "is a loop of symbolic links"
    except (OSError, ValueError) as err:
        problem = f"cannot be resolved ({err.strerror if isinstance(err, OSError) else err})"
    raise invalid_fields([FieldProblem(field, f"{short_repr(raw)} {problem}")])


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False
