"""Turn a scheduled step into device tensors, run the target once, and return the logits to verify.

All host-side bookkeeping (positions, slots, block tables, bounds) is built here from Python lists and
copied to the device in one go per tensor; nothing in the forward pass waits on the device. A request
that samples this step gets logits for its last token and each of its drafts (k + 1 rows).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from executor_service.engine.kv_cache import KVCache
from executor_service.engine.scheduler import ScheduledStep
from executor_service.models.attention_step import AttentionStep, build_attention_step, cache_slots, to_device
from executor_service.models.model import DecoderModel
from executor_service.parallel.driver import forward_with_logits, move_kv_slots
from executor_service.parallel.graphs import lockstep_for
from executor_service.runner.cuda_graphs import StepGraphs
from executor_service.runner.prefill_graphs import BatchPrefillGraphs, PrefillGraphs, prefill_buckets


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionStep
    logits_indices: torch.Tensor  # rows of the flattened tokens whose logits are verified
    sampled: list[int]  # index into step.requests of each request that samples (all its tokens computed)
    num_drafts: list[int]  # drafts verified for each sampled request
    row_starts: list[int]  # first row of each scheduled request among the step's tokens
    uniform_query_len: int | None  # every request samples with this many tokens: a CUDA graph can replay it


@dataclass
class StepOutput:
    logits: torch.Tensor  # [rows of logits_indices, V] fp32
    features: torch.Tensor | None  # [T, F] what the drafter reads of every row; None without a drafter


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        backend: str,
        device: torch.device,
        feature_layers: tuple[int, ...] | None = None,
    ) -> None:
        self.model, self.kv_cache, self.backend, self.device = model, kv_cache, backend, device
        self.block_size = kv_cache.block_size
        # None: no drafter. (): the final normed hidden state (EAGLE-1). Else these layers' outputs.
        self.feature_layers = feature_layers
        self.graphs: dict[int, StepGraphs] = {}  # by query length; set by the session where capturable
        self.prefill_graphs: PrefillGraphs | None = None  # a lone request's prompt rows (prefill_graphs.py)
        self.batch_prefill_graphs: BatchPrefillGraphs | None = None  # several requests' (prefill_graphs.py)
        self.step_counts: Counter[str] = Counter()  # "graph" / "eager": how steps ran (benchmarks read it)

    def prepare(self, step: ScheduledStep, causal: bool = True) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, sampled, num_drafts, logits_indices = [0], [], [], [], []
        for index, (request, num_new) in enumerate(zip(step.requests, step.num_new_tokens, strict=True)):
            start, stop = request.num_computed_tokens, request.num_computed_tokens + num_new
            known = min(stop, request.num_tokens)
            input_ids += request.token_ids(start, known) + request.draft_ids[: stop - known]
            positions += range(start, stop)
            slots += cache_slots(request.block_ids, start, stop, self.block_size)
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(stop)
            if stop == request.num_tokens + len(request.draft_ids):
                sampled.append(index)
                num_drafts.append(len(request.draft_ids))
                logits_indices += range(query_start_loc[-1] - 1 - len(request.draft_ids), query_start_loc[-1])
        block_ids = [r.block_ids for r in step.requests]
        attention = build_attention_step(
            self.backend, block_ids, step.num_new_tokens, seq_lens, slots, causal, self.device
        )
        query_len = step.num_new_tokens[0]
        uniform = len(sampled) == len(step.requests) and all(n == query_len for n in step.num_new_tokens)
        uniform = uniform and all(d == query_len - 1 for d in num_drafts)  # every row's logits are used
        return StepInputs(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            attention=attention,
            logits_indices=self._tensor(logits_indices, torch.int64),
            sampled=sampled,
            num_drafts=num_drafts,
            row_starts=query_start_loc[:-1],
            uniform_query_len=query_len if uniform else None,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> StepOutput:
        graphs = self.graphs.get(inputs.uniform_query_len or 0)
        step = inputs.attention
        if graphs is not None and len(inputs.sampled) <= graphs.max_batch:
            self.step_counts["graph"] += 1
            outputs = graphs.run(
                step.block_table, step.seq_lens, step.slot_mapping, inputs.positions, input_ids=inputs.input_ids
            )
            return StepOutput(outputs[0], outputs[1] if len(outputs) > 1 else None)
        rows = self._prefill_bucket(inputs)
        if rows is not None:
            assert self.prefill_graphs is not None
            self.step_counts["prefill graph"] += 1
            last_row = step.query_start_loc[1:] - 1  # the logits of the prompt's last row
            outputs = self.prefill_graphs.run(
                rows, inputs.positions, step, input_ids=inputs.input_ids, last_row=last_row
            )
            return _step_rows(outputs, inputs)
        rows = self._batch_prefill_bucket(inputs)
        if rows is not None:
            assert self.batch_prefill_graphs is not None
            self.step_counts["batch prefill graph"] += 1
            graphs = self.batch_prefill_graphs.graphs[rows]
            last_rows = {"last_row": inputs.logits_indices}
            outputs = graphs.run_rows(step, inputs.positions, last_rows, input_ids=inputs.input_ids)
            return _step_rows(outputs, inputs)
        self.step_counts["eager"] += 1
        logits, features = self.forward(inputs.input_ids, inputs.positions, step, inputs.logits_indices)
        return StepOutput(logits, features)

    def _prefill_bucket(self, inputs: StepInputs) -> int | None:
        """The prefill graph a step replays: one request's rows, none of them drafts (logits of its last row)."""
        if self.prefill_graphs is None or any(inputs.num_drafts):
            return None
        return self.prefill_graphs.bucket(inputs.attention, inputs.input_ids.shape[0])

    def _batch_prefill_bucket(self, inputs: StepInputs) -> int | None:
        """The batch prefill graph a step replays: several requests' rows, none of them drafts (logits of each
        sampling request's last row)."""
        if self.batch_prefill_graphs is None or any(inputs.num_drafts):
            return None
        return self.batch_prefill_graphs.bucket(inputs.attention, inputs.input_ids.shape[0])

    def capture_graphs(self, query_lens: list[int], max_batch: int, max_model_len: int) -> None:
        """Graphs for uniform steps of each query length (1: decode; k + 1: verify)."""
        for query_len in query_lens:

            def forward(step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
                logits, features = self.forward(x["input_ids"], positions, step, None)
                return (logits,) if features is None else (logits, features)

            graphs = StepGraphs(
                f"target (query length {query_len})", forward, self.backend, query_len, max_batch, max_model_len,
                self.block_size, self.device, {"input_ids": ((), torch.int64)},
                lockstep=lockstep_for(self.model, self.feature_layers or ()),
            )  # fmt: skip
            graphs.capture()
            self.graphs[query_len] = graphs

    def _prefill_forward(self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple:
        """The prefill graphs' forward: logits of the rows `last_row`, features of every row."""
        logits, features = self.forward(x["input_ids"], positions, step, x["last_row"])
        return (logits,) if features is None else (logits, features)

    def capture_prefill_graphs(self, max_rows: int, max_model_len: int) -> None:
        """Graphs for a lone request's prompt of up to `max_rows` rows (prefill_graphs.py)."""
        graphs = PrefillGraphs(
            "target prefill", self._prefill_forward, self.backend, prefill_buckets(max_rows), max_model_len,
            self.block_size, self.device, {"input_ids": ((), torch.int64)}, {"last_row": ((), torch.int64, 0)},
        )  # fmt: skip
        graphs.capture()
        self.prefill_graphs = graphs

    def capture_batch_prefill_graphs(self, max_rows: int, max_requests: int, max_model_len: int) -> None:
        """Graphs for steps of up to `max_requests` requests' rows, up to `max_rows` of them (prefill_graphs.py)."""
        graphs = BatchPrefillGraphs(
            "target batch prefill", self._prefill_forward, self.backend, prefill_buckets(max_rows), max_requests,
            max_model_len, self.block_size, self.device, {"input_ids": ((), torch.int64)},
            {"last_row": ((), torch.int64, 0)}, request_outputs=1,
        )  # fmt: skip
        graphs.capture(self.prefill_graphs.pool if self.prefill_graphs is not None else None)
        self.batch_prefill_graphs = graphs

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: AttentionStep, logits_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of `logits_indices` (None: every row) and the drafter's features of every row."""
        layers, feature_layers = self.kv_cache.layers, self.feature_layers or ()
        hidden, aux, logits = forward_with_logits(
            self.model, input_ids, positions, layers, step, feature_layers, logits_indices
        )  # under tensor parallelism one op on every rank (parallel/driver.py)
        if self.feature_layers is None:
            return logits, None
        return logits, torch.cat(aux, dim=-1) if aux else hidden

    def move_kv(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy the K/V of cache slots `sources` to `targets` in every layer (gathered first, so a slot both read
        and written is read before it is overwritten)."""
        move_kv_slots(self.model, self.kv_cache.storage, sources, targets)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)


def _step_rows(outputs: tuple[torch.Tensor, ...], inputs: StepInputs) -> StepOutput:
    """A prefill graph's outputs, padded to its bucket, cut to the step: the sampling requests' logits, the real
    rows' features."""
    features = outputs[1][: inputs.input_ids.shape[0]] if len(outputs) > 1 else None
    return StepOutput(outputs[0][: len(inputs.sampled)], features)
