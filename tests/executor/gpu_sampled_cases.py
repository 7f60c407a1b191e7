"""The sessions the GPU tests of the sampled and penalised device steps run: a chain and a tree, fp32, on CUDA."""

from __future__ import annotations

import pytest
import torch
from spec_builders import spec_session
from tree_cases import tree_session

from executor_service.server.session import ModelSession
from kernels import unavailable_reason
from specdec.v1 import common_pb2

BACKEND = "TRITON_ATTN"
FP32 = common_pb2.DTYPE_FLOAT32


def session_of(shape: str, cuda_graphs: bool = True) -> ModelSession:
    reason = unavailable_reason(BACKEND, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{BACKEND}: {reason}")
    if shape.startswith("chain"):  # "chain drawn": sampled requests' drafts drawn from q on the device step
        drawn = "on" if shape == "chain drawn" else "auto"
        return spec_session("eagle3", 5, BACKEND, device="cuda", dtype=FP32, num_kv_blocks=256,
                            max_num_batched_tokens=512, cuda_graphs=cuda_graphs, sampled_drafts=drawn)  # fmt: skip
    return tree_session("eagle3", common_pb2.DraftTree(top_k=3, verify_budget=8), 4, BACKEND, vocab_size=512,
                        num_kv_blocks=256, max_num_batched_tokens=512, device="cuda", dtype=FP32,
                        cuda_graphs=cuda_graphs)  # fmt: skip


def step_of(session: ModelSession):  # type: ignore[no-untyped-def]
    return session.engine.spec_step
