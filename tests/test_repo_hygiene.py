"""How the test suite is put together: what tests share lives in helper modules (engine_driving.py, tree_cases.py,
...), never in another test module: importing a test module runs its module-level setup, can collect its fixtures
twice, and ties two test files together so that neither can move or change alone. A conftest.py gives fixtures
without being imported; `from conftest import X` is refused too, since every folder's conftest is a module named
`conftest` and which one the name finds depends on the order pytest collected them in.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SKIPPED_DIRS = {"node_modules", "__pycache__", ".pytest_cache"}


def is_test_module(name: str) -> bool:
    """`name` ("test_engine", "tests.executor.test_engine", ".test_engine", "conftest") names a test module or a
    conftest."""
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported_test_modules(source: str) -> list[str]:
    """The test modules `source` imports, anywhere in it: `import test_x`, `from test_x import y`,
    `from tests.a.test_x import y`, `from .test_x import y` and `from . import test_x`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.module and is_test_module(node.module):
                found.append(module)
            elif not node.module:  # from . import test_x
                found += [module + alias.name for alias in node.names if is_test_module(alias.name)]
    return found


def python_files(root: Path) -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return sorted(found)


def test_no_module_under_tests_imports_a_test_module() -> None:
    files = python_files(TESTS)
    assert len(files) > 100, "tests/ has moved"
    offenders = [
        f"{path.relative_to(TESTS.parent)} imports {name}"
        for path in files
        for name in imported_test_modules(path.read_text())
    ]
    assert offenders == [], "move what they share into a helper module or a conftest.py"


def test_the_check_sees_every_form_of_importing_a_test_module() -> None:
    """Negative control: each way of reaching another test module or a conftest is found, helpers and libraries
    are not."""
    source = (
        "import pytest\n"
        "import test_engine\n"
        "from engine_driving import Collector\n"
        "from test_tree_decode import TREES\n"
        "from tests.executor.test_spec_decode import VOCAB\n"
        "from .test_streams import LONG\n"
        "from . import tree_cases, test_clients\n"
        "from testing_tools import x\n"
        "from conftest import TOKEN\n"
        "def later():\n"
        "    from test_fault_kill import Stream\n"
    )
    assert imported_test_modules(source) == [
        "test_engine",
        "test_tree_decode",
        "tests.executor.test_spec_decode",
        ".test_streams",
        ".test_clients",
        "conftest",
        "test_fault_kill",
    ]
