"""Per-request speculation on CUDA (bf16, CUDA graphs): a batch mixing num_speculative_tokens 0..k equals the
target-only output of the same backend while the drafter's passes replay graphs (EAGLE's chain with a
request's slots -1 past its own drafts), and a request admitted with its own smaller headroom runs to the end
alone in a cache that could not hold the loaded k's."""

from __future__ import annotations

import pytest
import torch
from executor_builders import tiny_session
from gpu_spec_cases import BF16, METHODS, prompts, tokens
from spec_builders import spec_session
from spec_checks import generate_request

from executor_service.engine.request import RequestOutput
from executor_service.sample.sampling import SamplingSettings
from executor_service.server.session import ModelSession
from executor_service.server.validation import check_generate

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

K = 5


def run(
    session: ModelSession, batch: dict[str, list[int]], max_tokens: int, own_k: dict[str, int | None]
) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in batch}
    for rid, prompt in batch.items():
        request = session.new_request(rid, prompt, SamplingSettings(), max_tokens, outputs[rid].append, own_k[rid])
        session.engine.add(request)
    session.engine.run_until_idle()
    assert session.kv_cache.allocator.num_used == 0
    return outputs


@pytest.mark.parametrize("method", METHODS)
def test_mixed_k_batch_equals_target_only_under_graphs(method: str) -> None:
    batch = prompts(12, seed=3)
    own_k = {rid: [None, 0, 1, 2, K][i % 5] for i, rid in enumerate(batch)}
    target = tiny_session(backend="TRITON_ATTN", device="cuda", num_kv_blocks=256, max_num_seqs=16, dtype=BF16)
    expected = tokens(run(target, batch, 24, dict.fromkeys(batch)))
    session = spec_session(method, K, "TRITON_ATTN", device="cuda", dtype=BF16, num_kv_blocks=256,
                           max_num_batched_tokens=256)  # fmt: skip
    assert session.proposer is not None and session.proposer.graphs
    outputs = run(session, batch, 24, own_k)
    assert tokens(outputs) == expected
    for rid, outs in outputs.items():
        finish = outs[-1].finish
        k = K if own_k[rid] is None else own_k[rid]
        assert finish is not None and len(finish.acceptance_per_position) <= k, rid
    assert any(name.endswith(" graph") for name in session.proposer.pass_counts), session.proposer.pass_counts


@pytest.mark.parametrize(("method", "k"), [("eagle", 1), ("eagle3", 2), ("dflash", 0)])
def test_own_headroom_fits_a_tight_cache_under_graphs(method: str, k: int) -> None:
    session = spec_session(method, 6, "TRITON_ATTN", device="cuda", dtype=BF16, num_kv_blocks=8)
    prompt = list(range(3, 93))
    most = check_generate(generate_request(prompt, None, k), session.limits, None)[2]
    outputs = run(session, {"largest": prompt}, most, {"largest": k})
    assert all(o.error is None for o in outputs["largest"])
    target = tiny_session(backend="TRITON_ATTN", device="cuda", num_kv_blocks=64, dtype=BF16)  # bf16: same backend
    assert tokens(outputs)["largest"] == tokens(run(target, {"largest": prompt}, most, {"largest": None}))["largest"]
    assert len(tokens(outputs)["largest"]) == most
