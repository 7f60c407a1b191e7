"""The executor tests' builders (tiny synthetic targets, speculative sessions, the dense greedy reference)
are shared with the training tests."""

from __future__ import annotations

import sys
from pathlib import Path

EXECUTOR_TESTS = str(Path(__file__).resolve().parents[1] / "executor")
if EXECUTOR_TESTS not in sys.path:
    sys.path.append(EXECUTOR_TESTS)
