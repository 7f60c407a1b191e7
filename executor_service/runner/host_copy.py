"""A step's result read back to the host behind the work that computes it.

The copy to pinned memory and its event are queued when the step is launched, before the step after it, so
reading the result waits for this step alone, not for whatever the device was given since (the speculative
step's `launch_following`, the overlapped decode step's next launch)."""

from __future__ import annotations

import torch


class HostCopy:
    """`values` copied to the host (pinned, non-blocking) once the device computed them; on the CPU the tensor
    itself."""

    def __init__(self, values: torch.Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = values

    def wait(self) -> torch.Tensor:
        """The host tensor, once the device wrote it (CUDA event synchronize releases the GIL: the gRPC loop
        streams meanwhile)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host

    def values(self) -> list:
        return self.wait().tolist()
