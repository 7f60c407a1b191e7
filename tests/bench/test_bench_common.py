"""bench/common.py and the rule it serves: a bench takes the product's mappings (dtypes, drafter methods) instead
of writing its own copy, which would drift from the product's unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from common import DTYPES, default_dtype

from specdec.v1 import common_pb2

BENCH = Path(__file__).resolve().parents[2] / "bench"
ENUM_PREFIXES = ("DTYPE_", "SPEC_METHOD_", "PLATFORM_")


def enum_mappings(source: str) -> list[int]:
    """Line numbers of dict literals whose keys or values name a DType, SpecMethod or Platform enum value."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            names = [
                n.attr
                for part in (*node.keys, *node.values)
                if part
                for n in ast.walk(part)
                if isinstance(n, ast.Attribute)
            ]
            if any(name.startswith(ENUM_PREFIXES) for name in names):
                found.append(node.lineno)
    return found


def test_no_bench_writes_its_own_enum_mapping() -> None:
    found = {path.name: enum_mappings(path.read_text()) for path in sorted(BENCH.glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_check_sees_a_mapping() -> None:
    """Negative control: the dict executor_bench.py once had."""
    assert enum_mappings(
        'DTYPES = {"bfloat16": common_pb2.DTYPE_BFLOAT16}\nX = {"a": (common_pb2.SPEC_METHOD_EAGLE, 7)}'
    ) == [1, 2]


def test_dtype_names_follow_the_wire_enum() -> None:
    assert sorted(DTYPES) == ["bfloat16", "float16", "float32"]
    for name, enum in DTYPES.items():
        assert common_pb2.DType.Name(enum) == f"DTYPE_{name.upper()}"
    assert default_dtype(torch.device("cpu")) == common_pb2.DTYPE_FLOAT32
