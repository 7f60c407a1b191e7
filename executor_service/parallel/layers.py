"""Megatron-style sharding of a loaded target, in place, for one rank of `world_size`.

Column-parallel (each rank keeps a slice of the output rows): qkv_proj by heads (its q, k and v heads) and
gate_up_proj (its slice of gate and of up). Row-parallel (a slice of the input columns, partial sums): o_proj
and down_proj; the bias is added on rank 0 only, so it counts once. Each rank attends over its own heads with
its own KV cache. The embedding and the LM head are vocabulary-parallel: each rank holds ceil(V / N) rows; the
embedding masks ids outside its rows, the LM head all-gathers its logits' columns.

The embedding's and the row-parallel layers' partial sums are summed over the ranks by the norm after them, with
its residual add (`reduce_norm`: one kernel on GPUs, fused_all_reduce.py), so every rank holds the same full
residual stream; the layers drafters read are summed on their own (`reduce`), so rank 0's drafter reads the
target's features without a gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from executor_service.models.config import ModelConfig
from executor_service.models.model import Attention, DecoderModel
from executor_service.parallel.all_reduce import all_reduce, sum_of
from executor_service.parallel.fused_all_reduce import all_reduce_add_rms_norm, begin_pass


def vocab_shard(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first id, rows held, rows padded to) of this rank's slice of the vocabulary."""
    per_rank = -(-vocab_size // world_size)
    start = min(rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start), per_rank


def _rows(weight: torch.Tensor, start: int, count: int, padded: int) -> torch.Tensor:
    """weight[start : start + count], zero rows appended up to `padded` (the last rank's short slice)."""
    shard = weight[start : start + count]
    if count < padded:
        shard = torch.cat([shard, shard.new_zeros(padded - count, *shard.shape[1:])])
    return shard.clone()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab_size: int, rank: int, world_size: int) -> None:
        super().__init__()
        self.start, count, padded = vocab_shard(vocab_size, rank, world_size)
        self.end = self.start + count
        self.weight = nn.Parameter(_rows(weight, self.start, count, padded), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows this rank holds, zeros elsewhere: a partial sum, which the first layer's norm sums over the ranks.
        A target pass starts here, so the fused all-reduces' buffer rotation restarts (fused_all_reduce.py)."""
        begin_pass()
        held = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(held, input_ids - self.start, 0)
        return F.embedding(local, self.weight) * held.unsqueeze(-1).to(self.weight.dtype)


class ParallelLMHead(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab_size: int, rank: int, world_size: int) -> None:
        super().__init__()
        start, count, padded = vocab_shard(vocab_size, rank, world_size)
        self.vocab_size, self.world_size = vocab_size, world_size
        self.weight = nn.Parameter(_rows(weight, start, count, padded), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [N, V] on every rank (each computes its columns; an all-gather joins them). One output
        tensor, the ranks' blocks stacked by rows, then laid side by side: NCCL's own all-gather, which a CUDA
        graph captures as it is (a list of outputs would add copies after it)."""
        local = F.linear(hidden, self.weight).contiguous()
        rows, columns = local.shape
        gathered = local.new_empty(self.world_size * rows, columns)
        dist.all_gather_into_tensor(gathered, local)
        joined = gathered.view(self.world_size, rows, columns).transpose(0, 1).reshape(rows, self.world_size * columns)
        return joined[:, : self.vocab_size]  # (no rows: a prompt chunk that samples nothing, run beside a step)


class RowParallelLinear(nn.Linear):
    """x [T, in / N] @ weight[:, slice].T, bias and residual added once (rank 0): `forward` leaves the partial sum
    to the next norm, `residual_forward` sums it over the ranks itself."""

    plain_forward = True  # forward is x @ weight.T + bias: the fused small-M GEMMs may run it (fused_layer.py)

    def __init__(self, full: nn.Linear, rank: int, world_size: int) -> None:
        per_rank = full.in_features // world_size
        super().__init__(per_rank, full.out_features, bias=full.bias is not None, device="meta")
        self.rank = rank
        columns = full.weight[:, rank * per_rank : (rank + 1) * per_rank]
        self.weight = nn.Parameter(columns.clone(), requires_grad=False)
        if full.bias is not None:
            bias = full.bias.detach().clone() if rank == 0 else torch.zeros_like(full.bias)
            self.bias = nn.Parameter(bias, requires_grad=False)

    def residual_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """What fused_ops.linear_residual calls for a layer that reduces across ranks."""
        keep = residual is not None and self.rank == 0
        out = torch.addmm(residual, x, self.weight.t()) if keep else x @ self.weight.t()
        if self.bias is not None:
            out = out + self.bias
        return all_reduce(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum (bias on rank 0): the next norm sums it over the ranks (`reduce_norm`)."""
        out = x @ self.weight.t()
        return out + self.bias if self.bias is not None else out


def _column(linear: nn.Linear, slices: list[tuple[int, int]]) -> None:
    """Keep the rows [start, stop) of each slice, in order (q, k, v or gate, up)."""
    weight = torch.cat([linear.weight[a:b] for a, b in slices])
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(torch.cat([linear.bias[a:b] for a, b in slices]).clone(), requires_grad=False)
    linear.out_features = weight.shape[0]


def _shard_attention(attn: Attention, rank: int, world_size: int) -> None:
    heads, kv_heads, size = attn.num_heads // world_size, attn.num_kv_heads // world_size, attn.head_size
    q, kv = attn.q_size, attn.kv_size
    q_slice = (rank * heads * size, (rank + 1) * heads * size)
    kv_slice = (rank * kv_heads * size, (rank + 1) * kv_heads * size)
    _column(attn.qkv_proj, [q_slice, (q + kv_slice[0], q + kv_slice[1]), (q + kv + kv_slice[0], q + kv + kv_slice[1])])
    attn.o_proj = RowParallelLinear(attn.o_proj, rank, world_size)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * size, kv_heads * size


def shard_model(model: DecoderModel, rank: int, world_size: int) -> DecoderModel:
    """Replace the target's weights by this rank's shards (the full modules are dropped, unless something
    else, such as a drafter's heads, still holds them)."""
    config = model.config
    with torch.no_grad():
        for layer in model.layers:
            _shard_attention(layer.self_attn, rank, world_size)
            mlp, width = layer.mlp, layer.mlp.intermediate_size // world_size
            _column(mlp.gate_up_proj, [(rank * width, (rank + 1) * width), (mlp.intermediate_size + rank * width,
                                       mlp.intermediate_size + (rank + 1) * width)])  # fmt: skip
            mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world_size)
            mlp.intermediate_size = width
        embed = VocabParallelEmbedding(model.embed_tokens.weight, config.vocab_size, rank, world_size)
        head = ParallelLMHead(model.lm_head.weight, config.vocab_size, rank, world_size)
        if config.tie_word_embeddings:
            head.weight = embed.weight
        model.embed_tokens, model.lm_head = embed, head
    for layer in model.layers:  # each sublayer's partial sum is reduced in the norm after it
        layer.reduce_norm = all_reduce_add_rms_norm
    model.reduce_norm, model.reduce = all_reduce_add_rms_norm, sum_of
    return model


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank runs: its heads and KV heads (what its KV cache holds)."""
    from dataclasses import replace

    return replace(config, num_heads=config.num_heads // world_size, num_kv_heads=config.num_kv_heads // world_size)
