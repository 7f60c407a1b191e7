"""What rank 0 sends the other ranks, so that they run the same target calls on their shards.

Each op is one message in the shared-memory ring (channel.py: the op, its sizes and any host-side values,
a few microseconds), then, where the op has one, one payload on the default group (NCCL on CUDA: device
tensors, no host copy). Followers never wait on the device to learn what to run next.

- LOAD (model id, byte count): a JSON body on the gloo control group (the LoadModelRequest and the target's
  backend); every rank then reports on the control group whether it built its shard.
- CACHE (model id, blocks, block size): each rank allocates its KV cache (its own heads) and reports.
- FORWARD (model id, tokens, requests, block-table width, max query / sequence length, causal, tree mask,
  logits rows, captured layers..., the captured layer ids): one int64 tensor holding input ids, positions,
  slots, block table, query starts, sequence lengths, the tree mask and the rows whose logits follow, in that
  order. Logits rows: NO_LOGITS, ALL_ROWS, or how many row indices the payload ends with. So a step's forward
  and its logits are one message (every rank holds the same final hidden states: no hidden rows travel).
- LOGITS (model id, rows): the hidden rows [rows, hidden] whose logits rank 0 wants (calls outside a step).
- MOVE_KV (model id, slots): source and destination cache slots (tree drafting's accepted K/V), int64.
- CAPTURE (model id, graph id, query length, largest batch, context length, tree depth, captured layers..., their
  ids): every rank captures the target's CUDA graphs of one kind, bucket by bucket in the same order (graphs.py).
  A tree step's graphs (tree depth > 0) also broadcast, inside them, the verify pass's positions and tree masks
  (`share_tree`) and the accepted path's K/V moves (`share_moves`).
- REPLAY (model id, graph id, bucket): every rank replays that bucket's graph. No payload: the graph itself
  starts with a broadcast of rank 0's static inputs (graphs.py), captured with the rest.
- PROFILE (model id, on): every follower starts (1) or stops (0) torch.profiler; at stop it writes where its
  steps' time went (rank_profile.py). Rank 0 profiles itself around the same steps.
- UNLOAD (model id), STOP.

Sampling, scheduling and drafting happen on rank 0 only, so sampling settings never travel.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from executor_service.models.attention_step import AttentionStep
from executor_service.parallel.state import TensorParallelGroup

HEADER = 12
LOAD_POLL_S = 0.01
NO_LOGITS, ALL_ROWS = -1, 0  # a FORWARD's logits rows besides a count of row indices
MAX_LOAD_BYTES = 64 << 20
MAX_FEATURE_LAYERS = 256  # a CAPTURE's captured layer ids, at most


class Op(enum.IntEnum):
    STOP = 0
    LOAD = 1
    UNLOAD = 2
    FORWARD = 3
    LOGITS = 4
    CACHE = 5
    # 6: the keep-alive of the gloo control wait, gone with it
    MOVE_KV = 7
    CAPTURE = 8
    REPLAY = 9
    PROFILE = 10


def send_message(group: TensorParallelGroup, op: Op, *values: int) -> None:
    """One message to every follower (rank 0, holding the group's lock)."""
    assert group.ring is not None, "rank 0 of a group without a control ring"
    group.ring.send([int(op), *values], group.wait_for_followers)


def send_header(group: TensorParallelGroup, op: Op, *values: int) -> None:
    """A message of fixed fields (at most HEADER - 1)."""
    if len(values) >= HEADER:
        raise ValueError(f"{len(values)} header fields")
    send_message(group, op, *values)


def send_load(group: TensorParallelGroup, model_id: int, body: dict) -> None:
    data = json.dumps(body).encode()
    if len(data) > MAX_LOAD_BYTES:
        raise ValueError(f"a load message of {len(data)} bytes is over {MAX_LOAD_BYTES}")
    send_header(group, Op.LOAD, model_id, len(data))
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    wait_while_alive(group, dist.broadcast(body, src=0, group=group.control, async_op=True))


def receive_load(group: TensorParallelGroup, num_bytes: int) -> dict:
    if not 0 < num_bytes <= MAX_LOAD_BYTES:
        raise ValueError(f"a load message of {num_bytes} bytes")
    data = torch.empty(num_bytes, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group.control)
    return json.loads(bytes(data.tolist()))


def all_loaded(group: TensorParallelGroup, ok: bool) -> int:
    """Every rank says whether its shard is built; the number of ranks that failed."""
    failed = torch.tensor([0 if ok else 1], dtype=torch.int64)
    work = dist.all_reduce(failed, group=group.control, async_op=True)
    if group.is_driver:
        wait_while_alive(group, work)
    else:
        work.wait()
    return int(failed.item())


def wait_while_alive(group: TensorParallelGroup, work: dist.Work) -> None:
    """Rank 0 waits for a gloo op of a load, which may take minutes on every rank, but no longer than the
    group lives: a follower frozen meanwhile (the watchdog's heartbeat) fails it with RankUnavailable."""
    while not work.is_completed():
        group.check_alive()
        time.sleep(LOAD_POLL_S)
    work.wait()  # raises what the op raised


@dataclass
class ForwardCall:
    input_ids: torch.Tensor
    positions: torch.Tensor
    step: AttentionStep
    aux_layer_ids: tuple[int, ...]
    logits_rows: torch.Tensor | None = None  # the rows whose logits follow (logits_of: which, if any)
    logits_of: int = NO_LOGITS  # NO_LOGITS, ALL_ROWS, or the number of row indices in logits_rows


def send_forward(group: TensorParallelGroup, model_id: int, call: ForwardCall) -> None:
    step = call.step
    tokens, (batch, width) = call.input_ids.shape[0], step.block_table.shape
    tree = step.tree_mask is not None
    aux = call.aux_layer_ids
    if len(aux) > MAX_FEATURE_LAYERS:
        raise ValueError(f"a forward capturing {len(aux)} layers")
    send_message(
        group, Op.FORWARD, model_id, tokens, batch, width, step.max_query_len, step.max_seq_len, int(step.causal),
        int(tree), call.logits_of, len(aux), *aux,
    )  # fmt: skip
    parts = [call.input_ids, call.positions, step.slot_mapping, step.block_table.flatten(), step.query_start_loc]
    parts += [step.seq_lens] + ([step.tree_mask] if tree else [])
    parts += [call.logits_rows] if call.logits_of > 0 and call.logits_rows is not None else []
    payload = torch.cat([p.to(torch.int64) for p in parts])
    dist.broadcast(payload, src=0)


def receive_forward(values: list[int], backend: str, device: torch.device) -> ForwardCall:
    """The FORWARD whose message fields are `values` (the model id first): its payload, received; no host sync."""
    tokens, batch, width, max_query_len, max_seq_len, causal, tree, logits_of, num_aux = values[1:10]
    aux = tuple(values[10 : 10 + num_aux])
    if len(aux) != num_aux or logits_of < NO_LOGITS:
        raise ValueError(f"a malformed forward message {values[:10]}")
    sizes = [tokens, tokens, tokens, batch * width, batch + 1, batch] + ([tokens] if tree else [])
    sizes += [logits_of] if logits_of > 0 else []
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
    rows = parts[-1] if logits_of > 0 else None
    return ForwardCall(input_ids, positions, step, aux, rows, logits_of)


def share_tree(positions: torch.Tensor, tree_mask: torch.Tensor) -> None:
    """Rank 0, inside a tree step's graph: the verify pass's positions and tree masks, built on the device from the
    drafts' layout, to the followers' graphs (`receive_tree`). Captured with the pass: no message."""
    dist.broadcast(torch.cat([positions.to(torch.int64), tree_mask.to(torch.int64)]), src=0)


def receive_tree(tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A follower's side of `share_tree` for a pass of `tokens` rows: (positions, tree masks)."""
    payload = torch.empty(2 * tokens, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    positions, tree_mask = payload.chunk(2)
    return positions, tree_mask


def share_moves(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Rank 0, inside a tree step's graph: the accepted path's K/V moves (source and destination slots), which every
    rank applies to its own heads (`receive_moves`). Captured with the step: no message."""
    dist.broadcast(torch.cat([src, dst]), src=0)


def receive_moves(count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.empty(2 * count, dtype=torch.int64, device=device)
    dist.broadcast(slots, src=0)
    src, dst = slots.chunk(2)
    return src, dst


def send_move(group: TensorParallelGroup, model_id: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """An eager K/V move: the MOVE_KV message, then the slots as a captured step shares them."""
    send_header(group, Op.MOVE_KV, model_id, src.shape[0])
    share_moves(src, dst)


def receive_move(values: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return receive_moves(values[1], device)


def send_logits(group: TensorParallelGroup, model_id: int, hidden: torch.Tensor) -> None:
    send_header(group, Op.LOGITS, model_id, hidden.shape[0])
    dist.broadcast(hidden.contiguous(), src=0)


def receive_logits(values: list[int], hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    hidden = torch.empty(values[1], hidden_size, dtype=dtype, device=device)
    dist.broadcast(hidden, src=0)
    return hidden


@dataclass(frozen=True)
class CaptureCall:
    """What a CAPTURE tells the followers: the graphs' id and shape, the layers a drafter reads, and for a tree
    step its depth (0 otherwise): its graphs also receive the tree's layout and the path's K/V moves."""

    graph_id: int
    query_len: int
    max_batch: int
    max_model_len: int
    aux_layer_ids: tuple[int, ...]
    tree_depth: int = 0


def send_capture(group: TensorParallelGroup, model_id: int, call: CaptureCall) -> None:
    aux = call.aux_layer_ids
    if len(aux) > MAX_FEATURE_LAYERS:
        raise ValueError(f"a capture of {len(aux)} feature layers")
    shape = (call.query_len, call.max_batch, call.max_model_len)
    send_message(group, Op.CAPTURE, model_id, call.graph_id, *shape, call.tree_depth, len(aux), *aux)


def receive_capture(values: list[int]) -> CaptureCall:
    graph_id, query_len, max_batch, max_model_len, tree_depth, num_aux = values[1:7]
    aux = tuple(values[7 : 7 + num_aux])
    if not 0 <= num_aux <= MAX_FEATURE_LAYERS or len(aux) != num_aux or tree_depth < 0:
        raise ValueError(f"a malformed capture message {values[:7]}")
    return CaptureCall(graph_id, query_len, max_batch, max_model_len, aux, tree_depth)


def pack_graph_inputs(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Rank 0's static inputs of one bucket as one int32 tensor (positions, slots, token ids and block ids all
    fit), the payload a graph broadcasts first (graphs.py)."""
    return torch.cat([t.flatten().to(torch.int32) for t in inputs])


def unpack_graph_inputs(payload: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """Fill this rank's static input views (the same as rank 0's, in the same order) from the payload."""
    for view, part in zip(inputs, payload.split([t.numel() for t in inputs]), strict=True):
        view.copy_(part.view(view.shape))
