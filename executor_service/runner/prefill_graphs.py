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

Steps of several requests without drafts (prompts arriving together, an arrival beside decodes) have their own
graphs (`BatchPrefillGraphs`; EngineSettings.batch_prefill_graphs, on by default): a bucket of rows, then of
requests; the real requests keep their own metadata and the bucket's spare rows belong to one padding request.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from executor_service.models.attention_step import AttentionStep
from executor_service.runner.cuda_graphs import GraphForward, RequestInputs, StepGraphs, TokenInputs

PREFILL_GRAPH_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Buckets past LAUNCH_BOUND_ROWS only for a model whose pass over them is still short: rows x parameters at most
# MAX_GRAPHED_ROW_PARAMETERS (~4 TFLOP a pass, a few ms on an H100-class GPU). A small model's long prefill is all
# launches eagerly (SmolLM2-135M: 2,000 prompt rows in 28 ms on an H200, against 3.2 ms for 512 rows in a graph);
# a large model's is compute-bound, and padding it up to the next bucket would cost more than the launches saved.
LAUNCH_BOUND_ROWS = 1024
MAX_GRAPHED_ROW_PARAMETERS = 2 * 10**12
# Requests a batch prefill graph serves at most: a step of more (a busy server's decodes beside an arrival) runs
# eagerly. Each request bucket of each row bucket is a graph (six per row bucket at 32), captured at load.
BATCH_PREFILL_MAX_REQUESTS = 32
# Backends whose kernels skip a request of no rows (the padding requests past the one that owns the spare rows), as
# TRITON_ATTN's does; FLASH_ATTN's varlen kernels are not known to here.
BATCH_PREFILL_BACKENDS = frozenset({"TRITON_ATTN"})


def batch_prefill_requests(max_num_seqs: int) -> int:
    """Real requests a load's batch prefill graphs serve at most (a step never has more than max_num_seqs)."""
    return min(max_num_seqs, BATCH_PREFILL_MAX_REQUESTS)


def capture_largest_first(graphs: Mapping[int, StepGraphs], pool: object | None = None) -> object | None:
    """Capture every bucket into one memory pool, largest first, so the smaller ones reuse its memory (`pool`: one to
    share from the start). Returns the pool."""
    for rows in sorted(graphs, reverse=True):
        graphs[rows].capture(pool)
        pool = graphs[rows].pool
    return pool


def prefill_graph_rows(max_num_batched_tokens: int, parameters: int, max_model_len: int) -> int:
    """The most rows of a step that a load's prefill graphs take, for a target of `parameters` (above): never more
    than a request may hold (a graph's capture runs one request over all its rows, and its block table is as wide
    as the model's length), nor than a step's."""
    launch_bound = max(LAUNCH_BOUND_ROWS, MAX_GRAPHED_ROW_PARAMETERS // max(parameters, 1))
    return min(max_num_batched_tokens, max_model_len, launch_bound)


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
        self.pool: object | None = None  # the graphs' memory pool, once captured (CUDA)
        self.graphs: dict[int, StepGraphs] = {}
        for rows in buckets:
            self.graphs[rows] = StepGraphs(
                f"{name} ({rows} rows)", forward, backend, rows, 1, max_model_len, block_size, device,
                token_inputs, request_inputs,
            )  # fmt: skip

    def capture(self) -> None:
        """Largest bucket first, every one into its pool: the smaller ones reuse its memory."""
        self.pool = capture_largest_first(self.graphs)

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


def request_buckets(max_requests: int, rows: int) -> list[int]:
    """Request counts a batch graph of `rows` rows is captured for, padding request included: powers of two from 2
    (one request and the padding one) up to the step's most requests plus one, at most one request a row."""
    top = min(max_requests + 1, rows)
    sizes = [2]
    while sizes[-1] < top:
        sizes.append(sizes[-1] * 2)
    return [min(size, top) for size in sizes]


class VarlenGraphs(StepGraphs):
    """One bucket of rows shared by several requests of any lengths (prefills, prompt chunks, decodes), one graph per
    request bucket. After the real requests' rows, the rest of the bucket belongs to one padding request, of its own
    length from position 0, that stores nothing; further padding requests have no rows. The real requests' metadata
    is their own, so every real row sees exactly its keys. The pass's outputs are per row, but for its first
    `request_outputs` (the target's logits: a row per request at most), per request of the bucket."""

    def __init__(
        self, name: str, forward: GraphForward, backend: str, rows: int, max_requests: int, max_model_len: int,
        block_size: int, device: torch.device, token_inputs: TokenInputs, request_inputs: RequestInputs | None = None,
        request_outputs: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(
            name, forward, backend, rows, max_requests, max_model_len, block_size, device, token_inputs, request_inputs
        )  # fmt: skip
        self.request_outputs = request_outputs
        self.query_start_loc.fill_(rows)  # until a run: every row the first request's, the others empty
        self.query_start_loc[0] = 0
        self.seq_lens.zero_()
        self.seq_lens[0] = rows
        self.padding_positions = torch.arange(rows, dtype=torch.int64, device=device)  # its rows are its sequence
        self.results: list[torch.Tensor] | None = None  # the outputs' buffers (`_run_eager`)

    def _buckets(self, max_batch: int) -> list[int]:
        return request_buckets(max_batch, self.query_len)

    def _tokens(self, size: int) -> int:
        return self.query_len

    def _run_eager(self, size: int) -> tuple[torch.Tensor, ...]:
        """The pass, its outputs copied into buffers that every request bucket shares (per-request outputs at the
        largest bucket's size, per-row ones whole): graphs of one pool would otherwise each keep their own outputs.
        The first call is the largest bucket's warm-up, outside any capture: it allocates them."""
        outputs = super()._run_eager(size)
        if self.results is None:
            largest = self.buckets[-1]
            self.results = [
                torch.empty((largest, *o.shape[1:]), dtype=o.dtype, device=o.device)
                if i < self.request_outputs
                else torch.empty_like(o)
                for i, o in enumerate(outputs)
            ]
        kept = [r[:size] if i < self.request_outputs else r for i, r in enumerate(self.results)]
        for result, output in zip(kept, outputs, strict=True):
            result.copy_(output)
        return tuple(kept)

    def fits(self, num_requests: int) -> bool:
        return num_requests < self.buckets[-1]

    def run_rows(
        self, step: AttentionStep, positions: torch.Tensor, per_request: dict[str, torch.Tensor] | None = None,
        **per_row: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """The graph's outputs over the step's requests (`fits`), per-row ones over all the bucket's rows. `per_row`:
        the token inputs of the step's rows; `per_request`: request inputs, as many values as given (the target's
        logits rows: at most one a request), the rest of the bucket padded."""
        count, n, rows = step.seq_lens.shape[0], positions.shape[0], self.query_len
        size = self._bucket(count + 1)
        self.query_start_loc[: count + 1].copy_(step.query_start_loc)
        self.query_start_loc[count + 1 : size + 1].fill_(rows)
        self.seq_lens[:count].copy_(step.seq_lens)
        self.seq_lens[count] = rows - n
        self.seq_lens[count + 1 : size].zero_()
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.slot_mapping[n:rows].fill_(-1)
        self.positions[:n].copy_(positions)
        self.positions[n:rows].copy_(self.padding_positions[: rows - n])
        for name, value in per_row.items():
            self.inputs[name][:n].copy_(value)
        self.block_table[:count, : step.block_table.shape[1]].copy_(step.block_table)
        for name, value in (per_request or {}).items():
            self.request_inputs[name][: value.shape[0]].copy_(value)
            self.request_inputs[name][value.shape[0] : size].fill_(self.pads[name])
        self.graphs[size].replay()
        return self.outputs[size]


class BatchPrefillGraphs:
    """Passes over several requests' rows: the target's steps without drafts, each request needing at most its last
    row's logits (prefills, prompt chunks, decodes beside them), and the drafter's context pass over them (its
    prompts', its held rows' flushes): a bucket of rows (PREFILL_GRAPH_ROWS), then of requests."""

    def __init__(
        self, name: str, forward: GraphForward, backend: str, buckets: list[int], max_requests: int,
        max_model_len: int, block_size: int, device: torch.device, token_inputs: TokenInputs,
        request_inputs: RequestInputs | None = None, request_outputs: int = 0,
    ) -> None:  # fmt: skip
        self.max_model_len = max_model_len
        self.graphs: dict[int, VarlenGraphs] = {}
        for rows in buckets:
            self.graphs[rows] = VarlenGraphs(
                f"{name} ({rows} rows)", forward, backend, rows, max_requests, max_model_len, block_size, device,
                token_inputs, request_inputs, request_outputs,
            )  # fmt: skip

    def capture(self, pool: object | None = None) -> None:
        """Largest bucket first, all into one pool (`pool`: the lone prefill graphs' of the same model, whose
        transients these reuse: one of its passes runs at a time)."""
        capture_largest_first(self.graphs, pool)

    def bucket(self, step: AttentionStep, num_rows: int) -> int | None:
        """The rows bucket a causal step of several requests replays; None: none fits (too many rows or requests, a
        tree, non-causal, or a padding request longer than the model's length)."""
        if not step.causal or step.tree_mask is not None or step.block_table.shape[0] < 2:
            return None
        count = step.block_table.shape[0]
        for rows in sorted(self.graphs):
            if rows >= num_rows and rows - num_rows <= self.max_model_len and self.graphs[rows].fits(count):
                return rows
        return None
