"""Rank 0's side: load the target on every rank, and run each target call on all of them.

The engine, the scheduler, sampling and the drafter stay on rank 0 and never see the other ranks: the
runner's target is a `TensorParallelModel`, which sends each call (protocol.py: one message in the shared
ring, one payload broadcast) before running it on its own shard; a step's forward and its logits go as one
call (`forward_with_logits`). One op is on the wire at a time (the group's lock). A failed collective, or
rank 0's watchdog (launcher.py), marks the group broken, so later calls fail at once with UNAVAILABLE
instead of waiting on a dead rank.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from executor_service.engine.kv_cache import copy_kv_slots
from executor_service.models.attention_step import AttentionStep
from executor_service.models.loader import LoadedModel
from executor_service.models.model import DecoderModel
from executor_service.parallel import protocol
from executor_service.parallel.protocol import ForwardCall, Op
from executor_service.parallel.state import RankUnavailable, TensorParallelGroup

log = logging.getLogger("specdec.executor")
_model_ids = itertools.count(1)
NAME_THE_RANK_S = 2.0
# Rank 0's models that may still run: a LOAD tells the followers to drop every other shard (a build that
# failed after its load, whose model was never served and so never released).
_live_models: weakref.WeakValueDictionary[int, TensorParallelModel] = weakref.WeakValueDictionary()


@contextmanager
def on_all_ranks(group: TensorParallelGroup, step: bool = False) -> Iterator[None]:
    """One op: its messages and its collectives, with no other op in between. `step`: a step's op (a forward,
    logits, a K/V move, a graph replay), which the step watchdog bounds; loads and captures it does not."""
    group.check_alive()
    with group.lock:
        group.check_alive()
        group.step_since = time.monotonic() if step else None
        try:
            yield
        except RankUnavailable:
            raise
        except (RuntimeError, OSError) as err:  # a peer gone or timed out, or rank 0 failed mid-op: out of step
            deadline = time.monotonic() + NAME_THE_RANK_S  # the watchdog names the rank that died, if one did
            while group.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            group.fail(f"an op on the ranks failed: {str(err)[:200]}")
            raise RankUnavailable(f"tensor parallelism is broken: {group.failure}") from err
        finally:
            group.step_since = None


class TensorParallelModel(nn.Module):
    """Rank 0's target: the same calls as DecoderModel's, each run on every rank's shard."""

    def __init__(self, model: DecoderModel, group: TensorParallelGroup, model_id: int) -> None:
        super().__init__()
        self.model, self.group, self.model_id = model, group, model_id
        self.config = model.config
        self._local = False  # a graph capture under way: the other ranks run the same passes already

    @contextmanager
    def locally(self) -> Iterator[None]:
        """Calls run on this rank's shard alone, sending nothing (parallel/graphs.py: inside a capture, whose
        op the other ranks follow by capturing the same passes)."""
        self._local = True
        try:
            yield
        finally:
            self._local = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        step: AttentionStep,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self._local:
            return self.model(input_ids, positions, kv_caches, step, aux_layer_ids)
        with on_all_ranks(self.group, step=True):
            protocol.send_forward(self.group, self.model_id, ForwardCall(input_ids, positions, step, aux_layer_ids))
            return self.model(input_ids, positions, kv_caches, step, aux_layer_ids)

    def run_with_logits(
        self, call: ForwardCall, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """A forward and its logits as one op (`forward_with_logits`): one message, one payload. Every rank holds
        the same final hidden states, so each picks the rows itself."""
        args = (call.input_ids, call.positions, kv_caches, call.step, call.aux_layer_ids, call.logits_rows)
        if self._local:  # a captured pass: a tree step's positions and masks, built on the device, go in the graph
            if call.step.tree_mask is not None:
                protocol.share_tree(call.positions, call.step.tree_mask)
            return forward_with_logits(self.model, *args)
        with on_all_ranks(self.group, step=True):
            protocol.send_forward(self.group, self.model_id, call)
            return forward_with_logits(self.model, *args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._local:
            return self.model.compute_logits(hidden)
        with on_all_ranks(self.group, step=True):
            protocol.send_logits(self.group, self.model_id, hidden)
            return self.model.compute_logits(hidden)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor, storage: torch.Tensor) -> None:
        """Every rank copies the K/V of cache slots `src` to `dst` in its own cache (a tree's accepted path). Inside
        a captured tree step the slots travel in the graph, where the followers' graphs receive them (graphs.py)."""
        if self._local:
            protocol.share_moves(src, dst)
            copy_kv_slots(storage, src, dst)
            return
        with on_all_ranks(self.group, step=True):
            protocol.send_move(self.group, self.model_id, src, dst)
            copy_kv_slots(storage, src, dst)

    def profile(self, on: bool) -> None:
        """Every follower starts or stops its profile of the steps between (rank_profile.py)."""
        with on_all_ranks(self.group):
            protocol.send_header(self.group, Op.PROFILE, self.model_id, int(on))

    def release(self) -> None:
        """The other ranks drop this model's shard and KV cache (a broken group has nothing to drop)."""
        if self.group.failure is None:
            with on_all_ranks(self.group):
                protocol.send_header(self.group, Op.UNLOAD, self.model_id)


def move_kv_slots(model: nn.Module, storage: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V of cache slots `src` to `dst` in every layer of `storage` (KVCache.storage): under tensor
    parallelism every rank moves its own heads' K/V, else the local cache's copy."""
    if isinstance(model, TensorParallelModel):
        model.move_kv(src, dst, storage)
    else:
        copy_kv_slots(storage, src, dst)


def forward_with_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    step: AttentionStep,
    aux_layer_ids: tuple[int, ...],
    logits_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(hidden, captured layers, logits of `logits_rows` or of every row) of the target: under tensor
    parallelism one op on every rank (model_runner.py's pass), else the model's two calls. No rows (a prompt
    chunk that samples nothing, run beside a device step): no logits on any rank (ALL_ROWS is 0 rows' count)."""
    if logits_rows is not None and logits_rows.shape[0] == 0:
        hidden, aux = model(input_ids, positions, kv_caches, step, aux_layer_ids)
        return hidden, aux, hidden.new_empty(0, model.config.vocab_size, dtype=torch.float32)
    if isinstance(model, TensorParallelModel):
        logits_of = protocol.ALL_ROWS if logits_rows is None else logits_rows.shape[0]
        call = ForwardCall(input_ids, positions, step, aux_layer_ids, logits_rows, logits_of)
        return model.run_with_logits(call, kv_caches)
    hidden, aux = model(input_ids, positions, kv_caches, step, aux_layer_ids)
    return hidden, aux, model.compute_logits(hidden if logits_rows is None else hidden[logits_rows])


class FullHeads(nn.Module):
    """The target's whole embedding and LM head, kept on rank 0 for its drafter (drafting.build_drafter)."""

    def __init__(self, model: DecoderModel) -> None:
        super().__init__()
        self.embed_tokens, self.lm_head = model.embed_tokens, model.lm_head


def load_on_all_ranks(
    group: TensorParallelGroup,
    request_bytes: bytes,
    backend: str,
    load_shard: Callable[[], tuple[LoadedModel, FullHeads | None]],
) -> tuple[LoadedModel, FullHeads | None]:
    """Every rank loads its shard of the target (`load_shard` on this rank: loading.load_target_shard); rank 0's
    LoadedModel holds a TensorParallelModel. Raises if any rank fails."""
    model_id = next(_model_ids)
    gc.collect()  # a failed build's model, still referenced from its traceback until now
    body = {"request": request_bytes.hex(), "backend": backend, "keep": sorted(_live_models)}
    error: BaseException | None = None
    with on_all_ranks(group):
        protocol.send_load(group, model_id, body)
        try:
            loaded, heads = load_shard()
        except BaseException as err:  # the ranks stay in step: raised once every rank has reported
            error = err
        failed = protocol.all_loaded(group, ok=error is None)
    if error is not None:
        raise error
    if failed:  # the other ranks have dropped their shards
        raise RuntimeError(f"{failed} tensor-parallel ranks could not load the target (see their logs)")
    model = _live_models[model_id] = TensorParallelModel(loaded.model, group, model_id)
    return replace(loaded, model=model), heads  # type: ignore[arg-type]


def allocate_on_all_ranks(model: TensorParallelModel, num_blocks: int, block_size: int) -> None:
    """The other ranks allocate their KV caches: the same blocks, their own heads."""
    group = model.group
    with on_all_ranks(group):
        protocol.send_header(group, Op.CACHE, model.model_id, num_blocks, block_size)
        failed = protocol.all_loaded(group, ok=True)
    if failed:
        raise RuntimeError(f"{failed} tensor-parallel ranks could not allocate the KV cache (see their logs)")
