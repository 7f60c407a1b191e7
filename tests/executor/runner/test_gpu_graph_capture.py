"""StepGraphs' capture on CUDA when a capture is invalidated: the bucket is captured again (into a pool of its own:
PyTorch leaves a failed capture's pool marked as recording) and every bucket replays the eager result."""

from __future__ import annotations

import pytest
import torch

from executor_service.models.attention_step import AttentionStep
from executor_service.runner.cuda_graphs import StepGraphs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = torch.device("cuda")


class FailsOnce:
    """A forward (x * 2 + position) whose first capture of batch 2 synchronizes the device, which a capture forbids."""

    def __init__(self) -> None:
        self.failed = False

    def __call__(self, step: AttentionStep, positions: torch.Tensor, inputs: dict[str, torch.Tensor]) -> tuple:
        if torch.cuda.is_current_stream_capturing() and positions.shape[0] == 2 and not self.failed:
            self.failed = True
            torch.cuda.synchronize()  # raises: the capture is invalidated
        return (inputs["x"] * 2 + positions.float(),)


def test_an_invalidated_capture_is_captured_again_and_every_bucket_replays() -> None:
    forward = FailsOnce()
    graphs = StepGraphs("test", forward, "TRITON_ATTN", 1, 8, 64, 16, CUDA, {"x": ((), torch.float32)})
    graphs.capture()
    assert forward.failed
    for count in (1, 2, 3, 8):
        x = torch.arange(count, dtype=torch.float32, device=CUDA) + 0.5
        positions = torch.arange(count, device=CUDA) * 3
        (out,) = graphs.replay(torch.zeros(count, 1, dtype=torch.int32, device=CUDA), positions, x=x)
        torch.testing.assert_close(out, x * 2 + positions.float())
