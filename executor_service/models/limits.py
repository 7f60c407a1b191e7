"""The largest size LoadModel accepts for each dimension of a model, its KV cache and its drafter.

Every bound is far above what released models use (the largest Llama: vocabulary 128256, hidden 16384,
126 layers, 128 heads of 128, context 131072), yet finite: a typo or a hostile request such as
`vocab_size: 2147483647` is refused by name before anything is sized from it, and the memory estimate
(memory.py) works with numbers that mean something. docs/api.md lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from executor_service.errors import FieldProblem

if TYPE_CHECKING:  # config.py reads its fields with these bounds
    from executor_service.models.config import ModelConfig

MAX_VOCAB_SIZE = 1 << 21  # 2097152
MAX_HIDDEN_SIZE = 1 << 16  # 65536
MAX_INTERMEDIATE_SIZE = 1 << 18  # 262144
MAX_NUM_LAYERS = 1024
MAX_NUM_HEADS = 1024
MAX_HEAD_SIZE = 1024
MAX_POSITION_EMBEDDINGS = 1 << 21  # the context length (max_model_len)
MAX_BLOCK_SIZE = 1024  # tokens per KV block
MAX_NUM_KV_BLOCKS = 1 << 20
MAX_DFLASH_BLOCK_SIZE = 64

# ModelConfig attribute -> its largest accepted value.
MODEL_BOUNDS = {
    "vocab_size": MAX_VOCAB_SIZE,
    "hidden_size": MAX_HIDDEN_SIZE,
    "intermediate_size": MAX_INTERMEDIATE_SIZE,
    "num_layers": MAX_NUM_LAYERS,
    "num_heads": MAX_NUM_HEADS,
    "num_kv_heads": MAX_NUM_HEADS,
    "head_size": MAX_HEAD_SIZE,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
}


def size_violation(field: str, value: object, maximum: int, minimum: int = 1) -> FieldProblem | None:
    """`value` must be an integer (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        return FieldProblem(field, f"an integer in [{minimum}, {maximum}] is required, got {short_repr(value)}")
    if not minimum <= value <= maximum:
        return FieldProblem(field, f"must be in [{minimum}, {maximum}], got {value}")
    return None


def model_violations(config: ModelConfig, name: Callable[[str], str]) -> list[FieldProblem]:
    """Every size of `config` out of its bound, and head counts that do not fit together; `name(attribute)` is
    the field each one is reported as (the request's or the config file's naming)."""
    found = [size_violation(name(attr), getattr(config, attr), bound) for attr, bound in MODEL_BOUNDS.items()]
    violations = [v for v in found if v is not None]
    bad = {v.field for v in violations}
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if name("num_heads") not in bad and name("num_kv_heads") not in bad and heads % kv_heads:
        violations.append(FieldProblem(name("num_kv_heads"), f"{kv_heads} must divide num_heads ({heads})"))
    if name("head_size") not in bad and config.head_size % 2:
        violations.append(FieldProblem(name("head_size"), f"must be even (rotary embedding), got {config.head_size}"))
    return violations


def short_repr(value: object, limit: int = 40) -> str:
    """A value as quoted in an error, truncated: error details must stay small whatever the input."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
