"""The target's CUDA graphs under tensor parallelism: every rank captures the same buckets and replays them in
lockstep, with the all-reduces and all-gathers of the sharded layers captured inside the graphs.

Rank 0 owns the graphs that the engine replays (decode, verify, the device-resident speculative step); each
gets a `TargetLockstep`. Before capturing, rank 0 sends CAPTURE: every follower builds a `StepGraphs` of the
same query length, buckets and context length around its own shard's pass (the target's forward and logits,
the same collectives in the same order as rank 0's) and captures it, bucket by bucket, while rank 0 captures
its own. Rank 0's captures call its shard directly (`TensorParallelModel.locally`): the followers are already
running the same passes.

Every graph, on every rank, starts with one broadcast of rank 0's static inputs for its bucket (positions,
slots, sequence lengths, the bucket's block table, input ids: `share_inputs`), captured like the collectives
after it. So a replay is one message (REPLAY: the graph and the bucket) and one graph launch per rank: no
payload outside the graph, no host sync on a follower. What rank 0's graph adds after the target (sampling,
the drafter on its whole heads) has no collective and runs on rank 0 alone.

Why graphs could hang before, and what keeps the ranks in step now:
- A bucket whose capture failed was captured again on that rank alone (StepGraphs' retry): its collectives ran
  again while the other ranks had moved on. Under a lockstep a failed capture now fails the load instead.
- The replay's inputs went eagerly on the NCCL stream, outside the graphs, between the gloo header and the
  replay: every replay was three operations on three queues (gloo, NCCL stream, the graph). Now the inputs'
  broadcast is the graph's own first node.

NCCL supports capturing collectives; gloo does not, and on the CPU the graphs are `EagerReplay`s, which rerun
the same passes (the inputs' broadcast and the collectives included) from the same buffers, so the lockstep is
tested there too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

from executor_service.engine.kv_cache import KVCache, copy_kv_slots
from executor_service.models.attention_step import AttentionStep
from executor_service.models.model import DecoderModel
from executor_service.parallel import protocol
from executor_service.parallel.driver import TensorParallelModel, on_all_ranks
from executor_service.parallel.state import TensorParallelGroup
from executor_service.runner.cuda_graphs import StepGraphs

_graph_ids = itertools.count(1)


class TargetLockstep:
    """Rank 0's side of one StepGraphs whose forward runs the sharded target. `tree_depth`: a tree step's (its
    graphs share the tree's layout and the path's K/V moves in the graph), else 0."""

    def __init__(self, model: TensorParallelModel, aux_layer_ids: tuple[int, ...], tree_depth: int = 0) -> None:
        self.model, self.aux_layer_ids, self.tree_depth = model, aux_layer_ids, tree_depth
        self.graph_id = next(_graph_ids)

    @contextmanager
    def capturing(self, graphs: StepGraphs) -> Iterator[None]:
        model = self.model
        with on_all_ranks(model.group), model.locally():
            call = protocol.CaptureCall(
                self.graph_id, graphs.query_len, graphs.max_batch, graphs.max_model_len, self.aux_layer_ids,
                self.tree_depth,
            )  # fmt: skip
            protocol.send_capture(model.group, model.model_id, call)
            yield

    @contextmanager
    def replaying(self, graphs: StepGraphs, size: int) -> Iterator[None]:
        model = self.model
        with on_all_ranks(model.group, step=True), model.locally():  # locally: a CPU replay reruns the passes
            protocol.send_header(model.group, protocol.Op.REPLAY, model.model_id, self.graph_id, size)
            yield

    def share_inputs(self, graphs: StepGraphs, size: int) -> None:
        share_inputs(graphs, size, 0)


class FollowerLockstep:
    """A follower's side of one StepGraphs: its capture and replays follow rank 0's messages (worker.py), and
    each of its passes starts with rank 0's inputs."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def capturing(self, graphs: StepGraphs) -> AbstractContextManager[None]:
        return nullcontext()

    def replaying(self, graphs: StepGraphs, size: int) -> AbstractContextManager[None]:
        return nullcontext()

    def share_inputs(self, graphs: StepGraphs, size: int) -> None:
        share_inputs(graphs, size, self.rank)


def share_inputs(graphs: StepGraphs, size: int, rank: int) -> None:
    """The first node of every pass of bucket `size`: rank 0's static inputs broadcast into every rank's."""
    inputs = graphs.target_inputs(size)
    if rank == 0:
        dist.broadcast(protocol.pack_graph_inputs(inputs), src=0)
        return
    payload = torch.empty(sum(t.numel() for t in inputs), dtype=torch.int32, device=graphs.device)
    dist.broadcast(payload, src=0)
    protocol.unpack_graph_inputs(payload, inputs)


def lockstep_for(model: torch.nn.Module, aux_layer_ids: tuple[int, ...], tree_depth: int = 0) -> TargetLockstep | None:
    """A lockstep for graphs around `model`'s passes (a tree step's: `tree_depth`): None without tensor
    parallelism."""
    return TargetLockstep(model, aux_layer_ids, tree_depth) if isinstance(model, TensorParallelModel) else None


def capture_follower(group: TensorParallelGroup, kv: KVCache, model: DecoderModel, backend: str,
                     values: list[int]) -> tuple[int, StepGraphs]:  # fmt: skip
    """A follower's side of CAPTURE: (graph id, its graphs), captured in step with rank 0's. A tree step's pass
    takes its positions and masks from rank 0's graph, then moves the accepted path's K/V as rank 0 does."""
    call = protocol.receive_capture(values)
    aux_layer_ids, depth = call.aux_layer_ids, call.tree_depth

    def forward(step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        if depth:
            positions, tree_mask = protocol.receive_tree(positions.shape[0], positions.device)
            step = replace(step, causal=True, tree_mask=tree_mask, _flex=None)
        hidden, _ = model(x["input_ids"], positions, kv.layers, step, aux_layer_ids)
        logits = model.compute_logits(hidden)  # rank 0's pass reads every row's logits (the all-gather)
        if depth:  # after rank 0's verification: the accepted drafts' K/V into place (spec_step._move_path)
            copy_kv_slots(kv.storage, *protocol.receive_moves(step.seq_lens.shape[0] * depth, positions.device))
        return (logits,)

    name = f"target shard (graph {call.graph_id}, query length {call.query_len}{', tree' if depth else ''})"
    graphs = StepGraphs(
        name, forward, backend, call.query_len, call.max_batch, call.max_model_len, kv.block_size, group.device,
        {"input_ids": ((), torch.int64)}, lockstep=FollowerLockstep(group.rank),
    )  # fmt: skip
    if graphs.max_batch != call.max_batch:
        raise ValueError(f"rank {group.rank} buckets up to {graphs.max_batch}, rank 0 up to {call.max_batch}")
    graphs.capture()
    return call.graph_id, graphs


def replay_follower(graphs: StepGraphs, values: list[int]) -> None:
    """A follower's side of REPLAY: the same bucket's graph (it receives rank 0's inputs itself)."""
    size = values[2]
    if size not in graphs.graphs:
        raise ValueError(f"a replay of bucket {size}: not captured here")
    graphs.graphs[size].replay()
