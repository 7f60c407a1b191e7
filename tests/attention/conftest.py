"""Kernel tests run on the GPU when there is one, else on the CPU with Triton's interpreter."""

from __future__ import annotations

import os

# The interpreter runs thousands of tiny numpy matmuls; a multi-threaded BLAS pool makes that several
# times slower on a small machine. Set before numpy / torch load their thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch

if not torch.cuda.is_available():
    torch.set_num_threads(1)
    # Must be set before any @triton.jit runs: kernels are built as interpreted functions then.
    os.environ.setdefault("TRITON_INTERPRET", "1")
