"""Speculative decoding on CUDA (bf16, CUDA graphs): greedy speculative output equals the target-only
output of the same backend, and graph-replayed drafting (metadata rebuilt before every replay) drafts
exactly what eager drafting drafts."""

from __future__ import annotations

import pytest
import torch
from executor_builders import tiny_session
from gpu_spec_cases import BF16, METHODS, prompts, tokens
from spec_builders import spec_session
from spec_metadata_runs import BATCHED_TOKENS, MAX_TOKENS, WRONG_AT, K, run_recorded
from spec_metadata_runs import prompts as metadata_prompts

from executor_service.engine.request import Request, RequestOutput
from executor_service.sample.sampling import DraftProbs, SamplingSettings
from executor_service.server.session import ModelSession
from kernels import unavailable_reason

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def run(session: ModelSession, batch: dict[str, list[int]], max_tokens: int) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in batch}
    for rid, prompt in batch.items():
        request = session.new_request(rid, prompt, SamplingSettings(), max_tokens, outputs[rid].append)
        session.engine.add(request)
    session.engine.run_until_idle()
    assert session.kv_cache.allocator.num_used == 0
    return outputs


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
    """R10 under graphs: every chain step / block advances its positions, seq_lens and slots on the device,
    in the device-resident step and in the host path's chain. Stale metadata would change the drafts; batch
    sizes are graph buckets so eager and graph passes run the same kernels on the same shapes."""
    batch = prompts(4, seed=9)
    drafts: dict[bool, list[tuple[str, int, list[int]]]] = {}
    for graphs in (True, False):
        session = spec_session(method, 5, "TRITON_ATTN", device="cuda", dtype=BF16, num_kv_blocks=256,
                               cuda_graphs=graphs, max_num_batched_tokens=256)  # fmt: skip
        proposer = session.proposer
        assert proposer is not None and bool(proposer.graphs) == graphs
        recorded = drafts.setdefault(graphs, [])
        set_drafts = proposer.set_drafts

        def recording(
            request: Request, ids: list[int], probs: DraftProbs | None = None, set_drafts=set_drafts,
            recorded=recorded,
        ) -> None:  # fmt: skip
            recorded.append((request.request_id, request.num_tokens, list(ids)))
            set_drafts(request, ids, probs)

        proposer.set_drafts = recording  # type: ignore[method-assign]
        run(session, batch, 30)
        assert session.engine.spec_step is not None and session.engine.spec_step.counts["graph" if graphs else "eager"]
    assert len(drafts[True]) > 10 and drafts[True] == drafts[False]


@pytest.mark.parametrize("method", METHODS)
def test_cuda_drafts_equal_cpu_drafts(method: str) -> None:
    """Every proposal on the GPU (Triton kernels, graphs, device-resident steps; fp32) equals the CPU's
    (CPU_ATTN, eager), which test_spec_metadata checks against a dense recompute. A batch of six requests with
    scripted acceptance, so chain steps start at a different offset in each request: a chain step that wrote
    or read another request's slots would change the drafts."""
    sessions = {
        device: spec_session(method, K, backend, device=device, max_num_batched_tokens=BATCHED_TOKENS)
        for device, backend in (("cpu", "CPU_ATTN"), ("cuda", "TRITON_ATTN"))
    }
    for part in ("loaded", "proposer"):  # synthetic weights are drawn on their device: the CPU's go to the GPU
        cpu_module, cuda_module = (_module(sessions[d], part) for d in ("cpu", "cuda"))
        cuda_module.load_state_dict(cpu_module.state_dict())  # copied in place: the captured graphs still read them
    drafted = {}
    for device, session in sessions.items():
        proposals, _ = run_recorded(session, metadata_prompts(), WRONG_AT, MAX_TOKENS)
        drafted[device] = [(p.request_id, p.tokens, p.drafts) for p in proposals]
        assert session.engine.spec_step is not None and session.engine.spec_step.counts
    assert len(drafted["cuda"]) >= 50 and drafted["cuda"] == drafted["cpu"]


def _module(session: ModelSession, part: str) -> torch.nn.Module:
    if part == "loaded":
        return session.loaded.model
    assert session.proposer is not None
    return session.proposer.drafter
