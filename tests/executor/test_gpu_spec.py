"""Speculative decoding on CUDA (bf16, CUDA graphs): greedy speculative output equals the target-only
output of the same backend, and graph-replayed drafting (metadata rebuilt before every replay) drafts
exactly what eager drafting drafts."""

from __future__ import annotations

import random

import pytest
import torch
from executor_builders import tiny_session
from spec_builders import spec_session

from executor_service.proposer import ProposeBatch
from executor_service.request import RequestOutput
from executor_service.sampling import SamplingSettings
from executor_service.session import ModelSession
from kernels import unavailable_reason
from specdec.v1 import common_pb2

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BF16 = common_pb2.DTYPE_BFLOAT16
METHODS = ["eagle", "eagle3", "dflash", "dflash_causal"]


def prompts(count: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(511) for _ in range(rng.randint(1, 60))] for i in range(count)}


def run(session: ModelSession, batch: dict[str, list[int]], max_tokens: int) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in batch}
    for rid, prompt in batch.items():
        request = session.new_request(rid, prompt, SamplingSettings(), max_tokens, outputs[rid].append)
        session.engine.add(request)
    session.engine.run_until_idle()
    assert session.kv_cache.allocator.num_used == 0
    return outputs


def tokens(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[int]]:
    for outs in outputs.values():
        assert all(o.error is None for o in outs), [o.error for o in outs]
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASH_ATTN"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [3, 7])
def test_bf16_speculative_equals_target_only(backend: str, method: str, k: int) -> None:
    reason = unavailable_reason(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    batch = prompts(16, seed=k)
    target = tiny_session(backend=backend, device="cuda", num_kv_blocks=256, max_num_seqs=16, dtype=BF16)
    expected = tokens(run(target, batch, 24))
    session = spec_session(method, k, backend, device="cuda", dtype=BF16, num_kv_blocks=256,
                           max_num_batched_tokens=256)  # fmt: skip
    assert 1 + k in session.engine.runner.graphs and session.proposer is not None and session.proposer.graphs
    outputs = run(session, batch, 24)
    assert tokens(outputs) == expected
    assert sum(o[-1].finish.verify_steps for o in outputs.values() if o[-1].finish) > 0


@pytest.mark.parametrize("method", METHODS)
def test_graph_drafting_drafts_what_eager_drafting_drafts(method: str) -> None:
    """R10 under graphs: every chain step / block replays with freshly copied positions, seq_lens and slots.
    Stale metadata would change the drafts; batch sizes are graph buckets so eager and graph passes run
    the same kernels on the same shapes."""
    batch = prompts(4, seed=9)
    drafts: dict[bool, list[tuple[str, int, list[int]]]] = {}
    for graphs in (True, False):
        session = spec_session(method, 5, "TRITON_ATTN", device="cuda", dtype=BF16, num_kv_blocks=256,
                               cuda_graphs=graphs, max_num_batched_tokens=256)  # fmt: skip
        proposer = session.proposer
        assert proposer is not None and bool(proposer.graphs) == graphs
        recorded = drafts.setdefault(graphs, [])
        propose = proposer.propose

        def recording(batch: ProposeBatch, propose=propose, recorded=recorded) -> None:
            propose(batch)
            for entry in batch.entries:
                if entry.propose:
                    recorded.append((entry.request.request_id, entry.request.num_tokens, list(entry.request.draft_ids)))

        proposer.propose = recording  # type: ignore[method-assign]
        run(session, batch, 30)
    assert len(drafts[True]) > 10 and drafts[True] == drafts[False]
