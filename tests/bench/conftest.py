"""The bench scripts' folder (bench/ is not a package) and the executor tests' builders (tiny synthetic targets,
the dense greedy reference, the paged-logits helper) on the import path of the bench tests."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS.parent / "bench", TESTS / "executor"):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
