"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with new inputs.

A decode step of an 8B model launches ~1000 small kernels; launched one by one from Python, the host
needs several times longer than the GPU needs to run them. Replaying a captured graph costs one launch.
Inputs live in static buffers that each replay overwrites; a batch is padded up to its bucket with
requests that write nothing (slot -1) and read one key. Attention is captured with `max_seq_len` set to
the context length, so one graph serves every sequence length.
"""

from __future__ import annotations

import logging

import torch

from executor_service.attention_step import AttentionStep
from executor_service.kv_cache import KVCache
from executor_service.model import DecoderModel

log = logging.getLogger("specdec.executor")

# Backends whose kernels are capture-safe: no host syncs, no host-dependent launch shapes beyond the
# bounds given at capture (checked on an H100: graph and eager decode give the same tokens). Flex builds
# its block mask with data-dependent shapes and runs eagerly.
GRAPH_BACKENDS = frozenset({"TRITON_ATTN", "FLASH_ATTN"})


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_batch + 1, 16)]
    return sorted({min(s, max_batch) for s in sizes})


class DecodeGraphs:
    def __init__(
        self, model: DecoderModel, kv_cache: KVCache, backend: str, max_batch: int, max_model_len: int
    ) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch)
        device = kv_cache.storage.device
        max_blocks = -(-max_model_len // kv_cache.block_size)
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._forward(size)  # warm up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs", extra={"batch_sizes": self.buckets})

    def _forward(self, size: int) -> torch.Tensor:
        step = AttentionStep(
            backend=self.backend,
            block_table=self.block_table[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        hidden, _ = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache.layers, step)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, V] of one decode token for each of B requests (B <= max_batch)."""
        count = input_ids.shape[0]
        size = next(s for s in self.buckets if s >= count)
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        self.slot_mapping[:count].copy_(slot_mapping)
        self.slot_mapping[count:size].fill_(-1)
        self.seq_lens[:count].copy_(seq_lens)
        self.seq_lens[count:size].fill_(1)
        self.block_table[:count, : block_table.shape[1]].copy_(block_table)
        self.graphs[size].replay()
        return self.logits[size][:count]
