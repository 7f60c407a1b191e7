"""The GPU speculative tests' drafters, prompts and outputs as token lists (imported as `gpu_spec_cases`: pytest
puts this folder on sys.path)."""

from __future__ import annotations

import random

from executor_service.engine.request import RequestOutput
from specdec.v1 import common_pb2

BF16 = common_pb2.DTYPE_BFLOAT16
METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


def prompts(count: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(511) for _ in range(rng.randint(1, 60))] for i in range(count)}


def tokens(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    for outs in outputs.values():
        assert all(o.error is None for o in outs), [o.error for o in outs]
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}
