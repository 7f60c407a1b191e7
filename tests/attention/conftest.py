"""Kernel tests run on the GPU when there is one, else on the CPU with Triton's interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit runs: kernels are built as interpreted functions then.
    os.environ.setdefault("TRITON_INTERPRET", "1")
