"""Ranks 1..N-1: follow rank 0's ops (protocol.py) on this rank's shard until STOP or rank 0 is gone.

A follower has no server, scheduler, sampler or drafter: it loads the target as rank 0 does, keeps its
shard, and runs each forward and logits call rank 0 sends, taking part in the collectives. It reads rank 0's
messages from the shared-memory ring (channel.py), polling; a thread of its own beats there, so rank 0 sees a
frozen follower. Anything that goes wrong here would leave it out of step with rank 0, so it exits non-zero
and rank 0's watchdog (launcher.py) marks the group broken. It exits too when rank 0 is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor_service.engine.kv_cache import KVCache, copy_kv_slots
from executor_service.models.model import DecoderModel
from executor_service.models.model_loading import load_target
from executor_service.parallel import protocol
from executor_service.parallel.channel import ControlRing
from executor_service.parallel.graphs import capture_follower, replay_follower
from executor_service.parallel.launcher import release_graphs
from executor_service.parallel.layers import rank_config
from executor_service.parallel.loading import load_target_shard
from executor_service.parallel.protocol import NO_LOGITS, Op
from executor_service.parallel.rank_profile import RankProfile
from executor_service.parallel.stack_dumps import dump_on_signal
from executor_service.parallel.state import TensorParallelGroup, destroy_tensor_parallel, init_tensor_parallel
from executor_service.runner.cuda_graphs import StepGraphs
from executor_service.server.wire import resolve_dtype, resolve_target
from specdec.v1 import executor_pb2

log = logging.getLogger("specdec.executor.follower")
# Polling the ring without sleeping for this long after each message keeps a step's start within microseconds
# on a GPU host (a core per rank); then sleeps of up to 1 ms. The CPU's ranks share its cores: no spinning.
SPIN_ENV = "SPECDEC_TP_SPIN_S"
CUDA_SPIN_S = 0.05
PARENT_CHECK_S = 1.0


class RankZeroGone(RuntimeError):
    pass


def parent_watch() -> Callable[[float], None]:
    """The ring's idle callback: raises once rank 0 (this process's parent) is gone."""
    parent, checked = os.getppid(), [time.monotonic()]

    def idle(_waited: float) -> None:
        now = time.monotonic()
        if now - checked[0] >= PARENT_CHECK_S:
            checked[0] = now
            if os.getppid() != parent:
                raise RankZeroGone(f"rank 0 (pid {parent}) is gone")

    return idle


@dataclass
class Shard:
    model: DecoderModel
    backend: str
    dtype: torch.dtype
    kv_cache: KVCache | None = None
    graphs: dict[int, StepGraphs] = field(default_factory=dict)  # by rank 0's graph id (parallel/graphs.py)


def load_shard(group: TensorParallelGroup, body: dict, model_root: Path | None) -> Shard:
    request = executor_pb2.LoadModelRequest.FromString(bytes.fromhex(body["request"]))
    source = resolve_target(request.target, model_root, "target")
    dtype = resolve_dtype(request.dtype, group.device)
    whole = lambda: load_target(source, dtype, group.device)  # noqa: E731
    loaded, _ = load_target_shard(source.path, whole, dtype, group.device, group.rank, group.world_size, False)
    return Shard(loaded.model, body["backend"], dtype)


@torch.inference_mode()
def follow(group: TensorParallelGroup, ring: ControlRing, model_root: Path | None) -> None:
    shards: dict[int, Shard] = {}
    spin_s = float(os.environ.get(SPIN_ENV) or (CUDA_SPIN_S if group.device.type == "cuda" else 0.0))
    idle = parent_watch()
    profiler = RankProfile(group.rank, group.device.type == "cuda")
    while True:
        message = ring.receive(idle, spin_s)
        op, values = Op(message[0]), message[1:]
        if op == Op.STOP:
            break
        if op == Op.PROFILE:
            profiler.toggle(bool(values[1]))
            continue
        if op in (Op.FORWARD, Op.REPLAY):
            profiler.count_step()
        run_op(group, shards, op, values, model_root)
    shards.clear()  # their graphs first: NCCL tears down only once no graph holds its collectives
    release_graphs()


def run_op(
    group: TensorParallelGroup, shards: dict[int, Shard], op: Op, values: list[int], model_root: Path | None
) -> None:
    """One of rank 0's ops on this rank's shards (its locals, graphs among them, end with it)."""
    model_id = values[0]
    if op == Op.LOAD:
        body = protocol.receive_load(group, values[1])
        for dropped in set(shards) - set(body["keep"]):  # rank 0 no longer has them
            del shards[dropped]
        try:
            shards[model_id] = load_shard(group, body, model_root)
        except Exception:
            log.exception("rank %d could not load the target", group.rank)
        if protocol.all_loaded(group, model_id in shards):  # some rank failed: nobody keeps it
            shards.pop(model_id, None)
    elif op == Op.CACHE:
        shard = shards[model_id]
        try:
            config = rank_config(shard.model.config, group.world_size)
            shard.kv_cache = KVCache(config, values[1], values[2], shard.dtype, group.device)
        except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
            log.exception("rank %d could not allocate the KV cache", group.rank)
        if protocol.all_loaded(group, shard.kv_cache is not None):
            shards.pop(model_id, None)
    elif op == Op.UNLOAD:
        shards.pop(model_id, None)
    elif op == Op.FORWARD:
        shard = shards[model_id]
        assert shard.kv_cache is not None, "a forward call before the KV cache"
        call = protocol.receive_forward(values, shard.backend, group.device)
        hidden, _ = shard.model(call.input_ids, call.positions, shard.kv_cache.layers, call.step, call.aux_layer_ids)
        if call.logits_of != NO_LOGITS:  # the same rows as rank 0's (every rank holds the same hidden states)
            shard.model.compute_logits(hidden if call.logits_rows is None else hidden[call.logits_rows])
    elif op == Op.MOVE_KV:
        shard = shards[model_id]
        assert shard.kv_cache is not None, "a K/V move before the KV cache"
        copy_kv_slots(shard.kv_cache.storage, *protocol.receive_move(values, group.device))
    elif op == Op.CAPTURE:
        shard = shards[model_id]
        assert shard.kv_cache is not None, "a capture before the KV cache"
        graph_id, graphs = capture_follower(group, shard.kv_cache, shard.model, shard.backend, values)
        shard.graphs[graph_id] = graphs
    elif op == Op.REPLAY:
        replay_follower(shards[model_id].graphs[values[1]], values)
    elif op == Op.LOGITS:
        shard = shards[model_id]
        hidden = protocol.receive_logits(values, shard.model.config.hidden_size, shard.dtype, group.device)
        shard.model.compute_logits(hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-executor-follower", description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="tcp://host:port of rank 0's store")
    parser.add_argument("--device", required=True)
    parser.add_argument("--control", required=True, help="rank 0's control ring (channel.py)")
    parser.add_argument("--model-root")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    dump_on_signal()
    ring = ControlRing.attach(Path(args.control), args.rank, args.world_size)
    ring.start_heartbeat()
    group = init_tensor_parallel(args.rank, args.world_size, args.init_method, torch.device(args.device))
    try:
        follow(group, ring, Path(args.model_root) if args.model_root else None)
    except Exception as err:  # rank 0 gone (a closed connection) or out of step: nothing left to follow
        log.error("rank %d stops following: %s", args.rank, str(err)[:300])
        return 1
    if not destroy_tensor_parallel():  # STOP: every rank leaves the group (state.py)
        log.warning("rank %d: the group was not torn down; exiting without the interpreter's teardown", args.rank)
        logging.shutdown()
        os._exit(0)  # the communicator's threads would end the process with std::terminate
    return 0


if __name__ == "__main__":
    sys.exit(main())
