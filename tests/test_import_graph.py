"""The package layout's import graph, read from the source (ast), not from what one run happens to import.

The services stand apart: the selector, the executor and the gateway each build on the shared packages (specdec_runtime,
selection, kernels, the specdec stubs) and never import the other service or the CLI; the shared packages import
no service. The selector's side stays torch-free, so that its image runs without torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("selector_service", "executor_service", "gateway_service")
CLI = "specdec_cli"
# package -> the top-level modules it must not import
FORBIDDEN = {
    "selector_service": {"executor_service", "gateway_service", CLI, "torch", "triton"},
    "executor_service": {"selector_service", "gateway_service", CLI},
    # The gateway is a client of the executors over gRPC only: the protos and the shared runtime, no model code.
    "gateway_service": {"executor_service", "selector_service", CLI, "selection", "kernels", "torch", "triton"},
    "specdec_runtime": {*SERVICES, CLI, "selection", "torch", "triton"},
    "selection": {*SERVICES, CLI, "torch", "triton"},
    "kernels": {*SERVICES, CLI, "specdec_runtime", "selection"},
}


def imported_packages(source: str) -> set[str]:
    """Top-level names of every absolute import in `source`, those inside functions included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def forbidden_imports(root: Path) -> list[str]:
    """'module imports package' for every import FORBIDDEN names, over the packages under `root`."""
    found = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            for name in sorted(imported_packages(path.read_text()) & forbidden):
                found.append(f"{path.relative_to(root)} imports {name}")
    return found


def test_no_service_imports_the_other() -> None:
    for package in FORBIDDEN:
        assert any((REPO_ROOT / package).rglob("*.py")), f"{package} has no modules: the layout changed"
    assert forbidden_imports(REPO_ROOT) == []


def test_the_check_sees_imports_anywhere_in_a_module(tmp_path: Path) -> None:
    """Negative control: imports at the top, inside a function and as `import a.b` are all found."""
    (tmp_path / "executor_service").mkdir()
    (tmp_path / "executor_service" / "late.py").write_text(
        "def f():\n    from selector_service.main import main\n    return main\n"
    )
    (tmp_path / "selection").mkdir()
    (tmp_path / "selection" / "top.py").write_text("import torch.nn\nfrom . import rules\n")
    assert forbidden_imports(tmp_path) == [
        "executor_service/late.py imports selector_service",
        "selection/top.py imports torch",
    ]
