"""The target's CUDA graphs under tensor parallelism: every rank captures the same buckets and replays them in
lockstep, with the all-reduces and all-gathers of the sharded layers captured inside the graphs.

Rank 0 owns the graphs that the engine replays (decode, verify, the device-resident speculative step); each
gets a `TargetLockstep`. Before capturing, rank 0 sends CAPTURE: every follower builds a `StepGraphs` of the
same query length, buckets and context length around its own shard's pass (the target's forward and logits,
the same collectives in the same order as rank 0's) and captures it, bucket by bucket, while rank 0 captures
its own. Rank 0's captures call its shard directly (`TensorParallelModel.locally`): the followers are already
running the same passes. Before each replay rank 0 sends REPLAY with the bucket it chose and the static inputs
the target reads; the followers copy them into their buffers and replay that bucket's graph, so the captured
collectives meet. What rank 0's graph adds after the target (sampling, the drafter on its whole heads) has no
collective and runs on rank 0 alone.

NCCL supports capturing collectives; gloo does not, and on the CPU the graphs are `EagerReplay`s, which rerun
the same passes (collectives included) from the same buffers, so the lockstep is tested there too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from executor_service.attention_step import AttentionStep
from executor_service.cuda_graphs import StepGraphs
from executor_service.model import DecoderModel
from executor_service.parallel import protocol
from executor_service.parallel.driver import TensorParallelModel, on_all_ranks
from executor_service.parallel.state import TensorParallelGroup

_graph_ids = itertools.count(1)


class TargetLockstep:
    """Rank 0's side of one StepGraphs whose forward runs the sharded target."""

    def __init__(self, model: TensorParallelModel, aux_layer_ids: tuple[int, ...]) -> None:
        self.model, self.aux_layer_ids = model, aux_layer_ids
        self.graph_id = next(_graph_ids)

    @contextmanager
    def capturing(self, graphs: StepGraphs) -> Iterator[None]:
        model = self.model
        with on_all_ranks(model.group), model.locally():
            shape = (graphs.query_len, graphs.max_batch, graphs.max_model_len)
            protocol.send_capture(model.group, model.model_id, self.graph_id, shape, self.aux_layer_ids)
            yield

    @contextmanager
    def replaying(self, graphs: StepGraphs, size: int, width: int) -> Iterator[None]:
        model = self.model
        with on_all_ranks(model.group), model.locally():  # locally: a CPU replay reruns the passes (EagerReplay)
            inputs = graphs.target_inputs(size, width)
            protocol.send_replay(model.group, model.model_id, self.graph_id, size, width, inputs)
            yield


def lockstep_for(model: torch.nn.Module, aux_layer_ids: tuple[int, ...]) -> TargetLockstep | None:
    """A lockstep for graphs around `model`'s passes: None without tensor parallelism."""
    return TargetLockstep(model, aux_layer_ids) if isinstance(model, TensorParallelModel) else None


def capture_follower(
    group: TensorParallelGroup,
    model: DecoderModel,
    kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
    backend: str,
    block_size: int,
    values: list[int],
) -> tuple[int, StepGraphs]:
    """A follower's side of CAPTURE: (graph id, its graphs), captured in step with rank 0's."""
    graph_id, (query_len, max_batch, max_model_len), aux_layer_ids = protocol.receive_capture(group, values)

    def forward(step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        hidden, _ = model(x["input_ids"], positions, kv_layers, step, aux_layer_ids)
        return (model.compute_logits(hidden),)  # rank 0's pass reads every row's logits (the all-gather)

    graphs = StepGraphs(
        f"target shard (graph {graph_id}, query length {query_len})", forward, backend, query_len, max_batch,
        max_model_len, block_size, group.device, {"input_ids": ((), torch.int64)},
    )  # fmt: skip
    if graphs.max_batch != max_batch:
        raise ValueError(f"rank {group.rank} buckets up to {graphs.max_batch}, rank 0 up to {max_batch}")
    graphs.capture()
    return graph_id, graphs


def replay_follower(graphs: StepGraphs, values: list[int]) -> None:
    """A follower's side of REPLAY: rank 0's static inputs into this rank's buffers, then the same bucket."""
    _graph_id, size, width = values[1:4]
    if size not in graphs.graphs or not 0 < width <= graphs.block_table.shape[1]:
        raise ValueError(f"a replay of bucket {size}, block-table width {width}: not captured here")
    protocol.receive_replay(graphs.target_inputs(size, width))
    graphs.graphs[size].replay()
