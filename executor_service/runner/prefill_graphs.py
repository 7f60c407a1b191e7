"""CUDA graphs for a lone request's rows: its prompt (or a chunk of it) padded up to a bucket of rows, through the
target (`ModelRunner.capture_prefill_graphs`) and then the drafter's context pass (`Proposer.capture_prefill_graphs`:
the prompt's rows, or a request's held rows flushed after steps without drafting).

At batch 1 a prefill step's time is the caller's time to first token, and an eager forward of a small model is
mostly Python and kernel launches: SmolLM2-135M's took ~16 ms on an H200 whatever the prompt's length, of which
its kernels ran 1.8 ms (bench/prefill_profile.py). One graph per bucket of rows (PREFILL_GRAPH_ROWS), batch 1.

A step of n rows replays bucket R >= n: rows n..R-1 are padding. They write no cache slot (slot -1), and the
request's sequence length is given as start + R, so each real row still sees exactly the keys up to its own
place (the kernels' causal rule counts a row's keys from the sequence's end); the padding rows read whatever
the blocks past the prompt hold, and their outputs are dropped (the target's logits come for the last real row
only: the one a prefill samples from). A model's graphs share one memory pool (one replays at a time), the target's
and the drafter's each their own (the drafter reads the target's outputs). The target's are not captured under
tensor parallelism: the other ranks replay rank 0's inputs, which its row index is not among (parallel/graphs.py);
there its prefill stays eager (the drafter runs on rank 0 alone, so its graphs are).
"""

from __future__ import annotations

import torch

from executor_service.models.attention_step import AttentionStep
from executor_service.runner.cuda_graphs import GraphForward, RequestInputs, StepGraphs, TokenInputs

PREFILL_GRAPH_ROWS = (16, 32, 64, 128, 256, 512, 1024)


def prefill_buckets(max_rows: int) -> list[int]:
    """The buckets a load captures: those that a step of at most `max_rows` rows can fill."""
    return [rows for rows in PREFILL_GRAPH_ROWS if rows <= max_rows]


class PrefillGraphs:
    def __init__(
        self,
        name: str,
        forward: GraphForward,
        backend: str,
        buckets: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        token_inputs: TokenInputs,
        request_inputs: RequestInputs | None = None,
    ) -> None:
        """`forward`: a StepGraphs forward over `token_inputs` (per row) and `request_inputs` (the one request's)."""
        self.max_model_len = max_model_len
        self.graphs: dict[int, StepGraphs] = {}
        for rows in buckets:
            self.graphs[rows] = StepGraphs(
                f"{name} ({rows} rows)", forward, backend, rows, 1, max_model_len, block_size, device,
                token_inputs, request_inputs,
            )  # fmt: skip

    def capture(self) -> None:
        """Largest bucket first, every one into its pool: the smaller ones reuse its memory."""
        pool = None
        for rows in sorted(self.graphs, reverse=True):
            self.graphs[rows].capture(pool)
            pool = self.graphs[rows].pool

    def bucket(self, step: AttentionStep, num_rows: int) -> int | None:
        """The bucket a step of one request's `num_rows` causal rows replays; None: none fits (more than one
        request, too many rows, a tree, or padding that would pass the model's length)."""
        if step.block_table.shape[0] != 1 or not step.causal or step.tree_mask is not None:
            return None
        start = step.max_seq_len - num_rows
        return next((r for r in sorted(self.graphs) if r >= num_rows and start + r <= self.max_model_len), None)

    def run(
        self, rows: int, positions: torch.Tensor, step: AttentionStep, **inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The outputs of bucket `rows` (`bucket`'s) over the step's rows (`positions` and `inputs`): views of the
        graph's outputs, per-row ones padded to `rows` (the caller keeps the real ones); the next replay overwrites
        them."""
        seq_lens = step.seq_lens + (rows - positions.shape[0])  # padding rows counted: each real row keeps its keys
        return self.graphs[rows].run(step.block_table, seq_lens, step.slot_mapping, positions, **inputs)
