"""What the GPU kernel-count guards share (test_gpu_fused_layer.py, test_gpu_fused_drafters.py): SmolLM2's shape
(the prefill graphs' memory tests take it too),
the bounds, and counting the kernels one warm eager run launches (imported as `kernel_counting`: pytest puts this
folder on sys.path)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from executor_service.models.config import ModelConfig

MAX_KERNELS_PER_LAYER = 6
CONTEXT = 300  # long enough for split-KV attention (two kernels)


def smollm2(num_layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=num_layers,
        num_heads=9, num_kv_heads=3, head_size=64, max_position_embeddings=2048, rope_theta=100000.0,
        tie_word_embeddings=True,
    )  # fmt: skip


def kernels_in(run: Callable[[], object]) -> int:
    """Kernels (copies and memsets left out) that `run` launches once warm, under inference mode."""

    def once() -> None:
        with torch.inference_mode():
            run()

    for _ in range(2):  # compile the Triton kernels, warm cuBLAS
        once()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(1 for name in names if not name.startswith(("Memcpy", "Memset")))
