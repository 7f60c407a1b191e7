"""Turn a scheduled step into device tensors, run the model once, and return the logits to sample.

All host-side bookkeeping (positions, slots, block tables, bounds) is built here from Python lists and
copied to the device in one go per tensor; nothing in the forward pass waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_service.attention_step import AttentionStep
from executor_service.cuda_graphs import DecodeGraphs
from executor_service.kv_cache import KVCache
from executor_service.model import DecoderModel
from executor_service.scheduler import ScheduledStep


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionStep
    logits_indices: torch.Tensor  # rows of the flattened tokens whose logits are sampled
    sampled: list[int]  # index into step.requests of each sampled row (requests whose tokens are all computed)
    decode_only: bool  # one new token per request, each sampled: what the CUDA graphs replay


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, backend: str, device: torch.device) -> None:
        self.model, self.kv_cache, self.backend, self.device = model, kv_cache, backend, device
        self.block_size = kv_cache.block_size
        self.graphs: DecodeGraphs | None = None  # set by the session when the backend can be captured

    def prepare(self, step: ScheduledStep, causal: bool = True) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, sampled, logits_indices = [0], [], [], []
        max_blocks = max(len(r.block_ids) for r in step.requests)
        block_table = []
        for index, (request, num_new) in enumerate(zip(step.requests, step.num_new_tokens, strict=True)):
            start, stop = request.num_computed_tokens, request.num_computed_tokens + num_new
            input_ids += request.token_ids(start, stop)
            positions += range(start, stop)
            blocks = request.block_ids
            slots += [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, stop)]
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(stop)
            block_table.append(blocks + [0] * (max_blocks - len(blocks)))
            if stop == request.num_tokens:
                sampled.append(index)
                logits_indices.append(query_start_loc[-1] - 1)
        attention = AttentionStep(
            backend=self.backend,
            block_table=self._tensor(block_table, torch.int32),
            query_start_loc=self._tensor(query_start_loc, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            slot_mapping=self._tensor(slots, torch.int64),
            max_query_len=max(step.num_new_tokens),
            max_seq_len=max(seq_lens),
            causal=causal,
        )
        return StepInputs(
            input_ids=self._tensor(input_ids, torch.int64),
            positions=self._tensor(positions, torch.int64),
            attention=attention,
            logits_indices=self._tensor(logits_indices, torch.int64),
            sampled=sampled,
            decode_only=len(input_ids) == len(sampled),
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [len(inputs.sampled), V] in fp32."""
        graphs = self.graphs
        if graphs is not None and inputs.decode_only and len(inputs.sampled) <= graphs.max_batch:
            step = inputs.attention
            return graphs.run(inputs.input_ids, inputs.positions, step.slot_mapping, step.block_table, step.seq_lens)
        hidden, _ = self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attention)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)
