"""datagen's engine is built by specdec_training (not by the executor's composition root): it must ask the selector
what LoadModel asks for the same target, and size its KV cache as LoadModel does; the engine's greedy responses
are checked against the dense reference in test_dense_generate.py."""

from __future__ import annotations

import torch

from executor_service.server.capabilities import probe
from executor_service.server.session import requested_kv_blocks, selection_request
from executor_service.server.validation import DEFAULT_BLOCK_SIZE
from executor_service.server.wire import DTYPE_ENUMS
from specdec.v1 import executor_pb2
from specdec_training.generation_engine import BLOCK_SIZE, EngineSizes, backend_request, kv_blocks
from specdec_training.target import target_source

CPU = torch.device("cpu")


def test_the_selector_is_asked_what_load_model_asks() -> None:
    config = target_source("synthetic:tiny").config
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        request = executor_pb2.LoadModelRequest(dtype=DTYPE_ENUMS[dtype])
        assert backend_request(config, dtype, CPU) == selection_request(request, config, probe(CPU), dtype)


def test_the_kv_cache_is_sized_as_load_model_sizes_it() -> None:
    config = target_source("synthetic:tiny").config
    assert BLOCK_SIZE == DEFAULT_BLOCK_SIZE
    for blocks in (0, 7):
        request = executor_pb2.LoadModelRequest(num_kv_blocks=blocks)
        assert kv_blocks(config, torch.float32, CPU, EngineSizes(num_kv_blocks=blocks)) == requested_kv_blocks(
            request, CPU
        )
