"""Small synthetic models and requests shared by the executor tests."""

from __future__ import annotations

import torch

from executor_service.models.config import ModelConfig
from executor_service.models.loader import LoadedModel, build_synthetic
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import EngineSettings, ModelSession, build_session
from executor_service.server.wire import resolve_target
from specdec.v1 import common_pb2, executor_pb2

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_size": 32,
}


def tiny_config(architecture: str = "llama", **changes: object) -> ModelConfig:
    fields = {**TINY, "max_position_embeddings": 512, "rope_theta": 10000.0, **changes}
    return ModelConfig(architecture=architecture, **fields)  # type: ignore[arg-type]


def gpu_test_config() -> ModelConfig:
    """The GPU tests' small target: 64-wide heads (the kernels' common size), GQA 8 / 2, 3 layers, 2,048 positions."""
    return tiny_config(
        "qwen3", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=8, head_size=64,
        max_position_embeddings=2048,
    )  # fmt: skip


def tiny_model(architecture: str = "llama", seed: int = 0, **changes: object) -> LoadedModel:
    return build_synthetic(tiny_config(architecture, **changes), seed, torch.float32, torch.device("cpu"))


def synthetic_source(architecture: str = "llama", seed: int = 0, **changes: int) -> executor_pb2.ModelSource:
    return executor_pb2.ModelSource(
        synthetic=executor_pb2.SyntheticModel(architecture=architecture, seed=seed, **{**TINY, **changes})
    )


def load_request(
    architecture: str = "llama", backend: str = "", num_kv_blocks: int = 64, block_size: int = 16, seed: int = 0
) -> executor_pb2.LoadModelRequest:
    return executor_pb2.LoadModelRequest(
        target=synthetic_source(architecture, seed),
        dtype=common_pb2.DTYPE_FLOAT32,
        attention=common_pb2.AttentionConfig(backend=backend),
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
    )


def tiny_session(
    backend: str = "CPU_ATTN",
    architecture: str = "llama",
    num_kv_blocks: int = 64,
    max_num_batched_tokens: int = 48,
    max_num_seqs: int = 8,
    device: str = "cpu",
    dtype: int = common_pb2.DTYPE_FLOAT32,
    cuda_graphs: bool = True,
    overlap_decode: bool = True,
) -> ModelSession:
    """A warmed-up session whose engine thread is NOT started unless the caller starts it (tests drive
    `engine.run_until_idle()` for determinism, or start the thread to test concurrency)."""
    request = load_request(architecture, backend, num_kv_blocks)
    request.dtype = dtype
    source = resolve_target(request.target, None, "target")
    decision = common_pb2.BackendDecision(backend=backend)
    settings = EngineSettings(max_num_batched_tokens, max_num_seqs, cuda_graphs, overlap_decode=overlap_decode)
    return build_session(source, request, decision, torch.device(device), settings, start=False)


def greedy(max_tokens: int | None = None, **changes: object) -> SamplingSettings:
    return SamplingSettings(max_tokens=max_tokens, **changes)  # type: ignore[arg-type]
