"""What rank 0 sends the other ranks, so that they run the same target calls on their shards.

Each message is a fixed header of host integers on the gloo control group (the op and the sizes), then,
where the op has one, a payload on the default group (NCCL on CUDA: device tensors, no host copy):

- LOAD (model id, byte count): a JSON body on the control group (the LoadModelRequest and the target's
  backend); every rank then reports on the control group whether it built its shard.
- CACHE (model id, blocks, block size): each rank allocates its KV cache (its own heads) and reports.
- FORWARD (model id, tokens, requests, block-table width, max query / sequence length, causal, tree mask,
  captured layers): one int64 tensor holding input ids, positions, slots, block table, query starts,
  sequence lengths, the tree mask and the captured layer ids, in that order.
- LOGITS (model id, rows): the hidden rows [rows, hidden] whose logits rank 0 wants.
- MOVE_KV (model id, slots): source and destination cache slots (tree drafting's accepted K/V), int64.
- CAPTURE (model id, graph id, query length, largest batch, context length, captured layers): every rank
  captures the target's CUDA graphs of one kind, bucket by bucket in the same order (parallel/graphs.py); the
  captured layer ids follow on the control group.
- REPLAY (model id, graph id, bucket, block-table width): the static inputs the target reads, int64 (positions,
  slots, sequence lengths, block table, input ids); then every rank replays that bucket's graph.
- UNLOAD (model id), STOP, NOOP (an idle rank 0's keep-alive, so the followers' wait never times out).

Sampling, scheduling and drafting happen on rank 0 only, so sampling settings never travel.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor_service.attention_step import AttentionStep, to_device
from executor_service.parallel.state import TensorParallelGroup

HEADER = 12
MAX_LOAD_BYTES = 64 << 20
MAX_FEATURE_LAYERS = 256  # a CAPTURE's captured layer ids, at most


class Op(enum.IntEnum):
    STOP = 0
    LOAD = 1
    UNLOAD = 2
    FORWARD = 3
    LOGITS = 4
    CACHE = 5
    NOOP = 6  # keep-alive from an idle rank 0
    MOVE_KV = 7
    CAPTURE = 8
    REPLAY = 9


def send_header(group: TensorParallelGroup, op: Op, *values: int) -> None:
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = int(op)
    header[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group.control)


def receive_header(group: TensorParallelGroup) -> tuple[Op, list[int]]:
    header = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group.control)
    values = header.tolist()
    return Op(values[0]), values[1:]


def send_load(group: TensorParallelGroup, model_id: int, body: dict) -> None:
    data = json.dumps(body).encode()
    if len(data) > MAX_LOAD_BYTES:
        raise ValueError(f"a load message of {len(data)} bytes is over {MAX_LOAD_BYTES}")
    send_header(group, Op.LOAD, model_id, len(data))
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group.control)


def receive_load(group: TensorParallelGroup, num_bytes: int) -> dict:
    if not 0 < num_bytes <= MAX_LOAD_BYTES:
        raise ValueError(f"a load message of {num_bytes} bytes")
    data = torch.empty(num_bytes, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group.control)
    return json.loads(bytes(data.tolist()))


def all_loaded(group: TensorParallelGroup, ok: bool) -> int:
    """Every rank says whether its shard is built; the number of ranks that failed."""
    failed = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(failed, group=group.control)
    return int(failed.item())


@dataclass
class ForwardCall:
    input_ids: torch.Tensor
    positions: torch.Tensor
    step: AttentionStep
    aux_layer_ids: tuple[int, ...]


def send_forward(group: TensorParallelGroup, model_id: int, call: ForwardCall) -> None:
    step = call.step
    tokens, (batch, width) = call.input_ids.shape[0], step.block_table.shape
    tree = step.tree_mask is not None
    send_header(
        group, Op.FORWARD, model_id, tokens, batch, width, step.max_query_len, step.max_seq_len, int(step.causal),
        int(tree), len(call.aux_layer_ids),
    )  # fmt: skip
    device = call.input_ids.device
    parts = [call.input_ids, call.positions, step.slot_mapping, step.block_table.flatten(), step.query_start_loc]
    parts += [step.seq_lens] + ([step.tree_mask] if tree else [])
    parts.append(to_device(list(call.aux_layer_ids), torch.int64, device))  # no wait for the step in flight
    payload = torch.cat([p.to(torch.int64) for p in parts])
    dist.broadcast(payload, src=0)


def receive_forward(values: list[int], backend: str, device: torch.device) -> ForwardCall:
    tokens, batch, width, max_query_len, max_seq_len, causal, tree, num_aux = values[1:9]
    sizes = [tokens, tokens, tokens, batch * width, batch + 1, batch] + ([tokens] if tree else []) + [num_aux]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    parts = list(payload.split(sizes))
    input_ids, positions, slots, table, starts, seq_lens = parts[:6]
    step = AttentionStep(
        backend=backend,
        block_table=table.view(batch, width).to(torch.int32),
        query_start_loc=starts.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        slot_mapping=slots,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        causal=bool(causal),
        tree_mask=parts[6] if tree else None,
    )
    return ForwardCall(input_ids, positions, step, tuple(parts[-1].tolist()))


def send_move(group: TensorParallelGroup, model_id: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    send_header(group, Op.MOVE_KV, model_id, src.shape[0])
    dist.broadcast(torch.cat([src, dst]), src=0)


def receive_move(values: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.empty(2 * values[1], dtype=torch.int64, device=device)
    dist.broadcast(slots, src=0)
    src, dst = slots.chunk(2)
    return src, dst


def send_logits(group: TensorParallelGroup, model_id: int, hidden: torch.Tensor) -> None:
    send_header(group, Op.LOGITS, model_id, hidden.shape[0])
    dist.broadcast(hidden.contiguous(), src=0)


def receive_logits(values: list[int], hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    hidden = torch.empty(values[1], hidden_size, dtype=dtype, device=device)
    dist.broadcast(hidden, src=0)
    return hidden


def send_capture(group: TensorParallelGroup, model_id: int, graph_id: int, shape: tuple[int, int, int],
                 aux_layer_ids: tuple[int, ...]) -> None:  # fmt: skip
    """`shape`: the graphs' query length, largest batch and context length."""
    send_header(group, Op.CAPTURE, model_id, graph_id, *shape, len(aux_layer_ids))
    if aux_layer_ids:
        dist.broadcast(torch.tensor(aux_layer_ids, dtype=torch.int64), src=0, group=group.control)


def receive_capture(group: TensorParallelGroup, values: list[int]) -> tuple[int, tuple[int, int, int], tuple[int, ...]]:
    """(graph id, (query length, largest batch, context length), captured layer ids) of a CAPTURE."""
    graph_id, query_len, max_batch, max_model_len, num_aux = values[1:6]
    if not 0 <= num_aux <= MAX_FEATURE_LAYERS:
        raise ValueError(f"a capture of {num_aux} feature layers")
    aux = torch.empty(num_aux, dtype=torch.int64)
    if num_aux:
        dist.broadcast(aux, src=0, group=group.control)
    return graph_id, (query_len, max_batch, max_model_len), tuple(aux.tolist())


def send_replay(group: TensorParallelGroup, model_id: int, graph_id: int, size: int, width: int,
                inputs: list[torch.Tensor]) -> None:  # fmt: skip
    """`inputs`: the bucket's static input views (StepGraphs.target_inputs), already filled for this step."""
    send_header(group, Op.REPLAY, model_id, graph_id, size, width)
    dist.broadcast(torch.cat([t.flatten().to(torch.int64) for t in inputs]), src=0)


def receive_replay(inputs: list[torch.Tensor]) -> None:
    """Fill this rank's static input views (the same as rank 0's, in the same order) from rank 0's."""
    payload = torch.empty(sum(t.numel() for t in inputs), dtype=torch.int64, device=inputs[0].device)
    dist.broadcast(payload, src=0)
    for view, part in zip(inputs, payload.split([t.numel() for t in inputs]), strict=True):
        view.copy_(part.view(view.shape))
