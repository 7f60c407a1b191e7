"""The engine datagen runs the target on, built here from the executor's parts: KV cache, model runner,
scheduler (with prefix caching) and engine, what LoadModel builds for a target without a drafter. Building it
here keeps the trainer off the executor's composition root (session.py) and its request messages.

The backend comes from the same selection code LoadModel asks in-process, fed this machine's capability report;
those two speak protobuf (common_pb2, selector_pb2), so this module is the trainer's one touch of the stubs.
LoadModel's backend-claims check is left out: it is for decisions that did not come from this executor's selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.engine.engine import Engine, StepObserver
from executor_service.engine.kv_cache import KVCache, blocks_for_memory_fraction, blocks_needed
from executor_service.engine.prefix_cache import PrefixCache, tokens_after_block
from executor_service.engine.request import Request, Sink
from executor_service.engine.scheduler import Scheduler
from executor_service.models.config import ModelConfig
from executor_service.models.limits import MAX_NUM_KV_BLOCKS
from executor_service.models.loader import LoadedModel
from executor_service.runner.cuda_graphs import GRAPH_BACKENDS
from executor_service.runner.model_runner import ModelRunner
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.capabilities import probe
from selection.selector import Selector
from specdec.v1 import common_pb2, selector_pb2

BLOCK_SIZE = 16  # LoadModel's default block size (validation.DEFAULT_BLOCK_SIZE)
CPU_KV_TOKENS = 16384  # LoadModel's KV cache on the CPU when the request sizes none


@dataclass(frozen=True)
class EngineSizes:
    """How large the engine is: its batch, and its KV cache (0 blocks: `gpu_memory_utilization` of a GPU, or
    16k tokens on the CPU, as LoadModel sizes it)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    num_kv_blocks: int = 0
    gpu_memory_utilization: float = 0.9


@dataclass
class TargetEngine:
    """The target on a running engine (driven by the caller: `engine.run_until_idle()`)."""

    engine: Engine
    kv_cache: KVCache
    config: ModelConfig

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def new_request(
        self, request_id: str, prompt: list[int], settings: SamplingSettings, max_tokens: int, sink: Sink
    ) -> Request:
        return Request(
            request_id=request_id,
            prompt_ids=prompt,
            settings=settings,
            max_tokens=max_tokens,
            eos_token_ids=frozenset(self.config.eos_token_ids),
            sink=sink,
            num_draft_tokens=0,
            num_lookahead_tokens=0,
        )

    def shutdown(self) -> None:
        self.engine.shutdown()


def backend_request(
    config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> selector_pb2.SelectBackendsRequest:
    """What LoadModel asks the selector for this target alone: this machine's report and the target's layers."""
    layers = common_pb2.LayerSpec(
        head_size=config.head_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        dtype=common_pb2.DType.Value(f"DTYPE_{str(dtype).removeprefix('torch.').upper()}"),
        kv_cache_dtype="auto",
        block_size=BLOCK_SIZE,
    )
    no_preference = common_pb2.AttentionConfig()  # as a LoadModel that names no backend
    return selector_pb2.SelectBackendsRequest(hardware=probe(device), target_layers=layers, attention=no_preference)


def target_backend(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> str:
    """The attention backend the selector picks for the target's layers on `device`."""
    return Selector().select(backend_request(config, dtype, device)).target.backend


def kv_blocks(config: ModelConfig, dtype: torch.dtype, device: torch.device, sizes: EngineSizes) -> int:
    """The KV cache's blocks: as `sizes` names them, else as LoadModel sizes a cache the request leaves unsized."""
    if sizes.num_kv_blocks > 0:
        return sizes.num_kv_blocks
    if device.type != "cuda":
        return blocks_needed(CPU_KV_TOKENS, BLOCK_SIZE)
    fitting = blocks_for_memory_fraction([config], BLOCK_SIZE, dtype, device, sizes.gpu_memory_utilization)
    most = blocks_needed(sizes.max_num_seqs * config.max_position_embeddings, BLOCK_SIZE)
    return min(fitting, most, MAX_NUM_KV_BLOCKS)


def build_target_engine(
    loaded: LoadedModel, sizes: EngineSizes, device: torch.device, on_step: StepObserver | None = None
) -> TargetEngine:
    """The engine over `loaded`'s weights as they are (dtype included); its decode steps captured as CUDA graphs
    on GPUs where the backend allows."""
    config, dtype = loaded.config, loaded.model.embed_tokens.weight.dtype
    backend = target_backend(config, dtype, device)
    kv_cache = KVCache(config, kv_blocks(config, dtype, device, sizes), BLOCK_SIZE, dtype, device)
    runner = ModelRunner(loaded.model, kv_cache, backend, device)
    prefix_cache = PrefixCache(kv_cache.allocator, BLOCK_SIZE, tokens_after_block(None))
    batch = sizes.max_num_batched_tokens, sizes.max_num_seqs
    max_model_len = config.max_position_embeddings
    scheduler = Scheduler(kv_cache.allocator, BLOCK_SIZE, *batch, 0, max_model_len, prefix_cache)
    engine = Engine(runner, scheduler, max_model_len, on_step)
    if device.type == "cuda" and backend in GRAPH_BACKENDS:
        runner.capture_graphs([1], sizes.max_num_seqs, max_model_len)
    return TargetEngine(engine, kv_cache, config)
