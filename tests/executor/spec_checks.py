"""Checks shared by the speculative engine tests: nothing leaks after a run, the verify steps a scripted drafter
takes, and a GenerateRequest with its own num_speculative_tokens (imported as `spec_checks`: pytest puts this folder
on sys.path)."""

from __future__ import annotations

import random

from executor_service.server.session import ModelSession
from specdec.v1 import executor_pb2

VOCAB = 512


def prompts(count: int, seed: int, longest: int = 40, vocab: int = VOCAB) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for i in range(count)}


def assert_no_leak(session: ModelSession) -> None:
    """Nothing left of finished requests: cache blocks, scheduled work, adaptive speculation's counts per request."""
    assert session.kv_cache.allocator.num_used == 0
    assert not session.engine.scheduler.has_work()
    speculation = session.engine.speculation
    assert speculation is None or speculation.tracked_requests == 0


def scripted_verify_steps(max_tokens: int, k: int, wrong_at: int | None) -> int:
    """Verify steps when each accepts min(wrong_at, k) drafts: the prefill emits the first token, every verify
    step the accepted drafts and one more (drafts are not cut at max_tokens: the extra tokens are dropped)."""
    per_step = (k if wrong_at is None else min(wrong_at, k)) + 1
    return -(-(max_tokens - 1) // per_step)


def generate_request(prompt: list[int], max_tokens: int | None, k: int | None) -> executor_pb2.GenerateRequest:
    request = executor_pb2.GenerateRequest(request_id="r", token_ids=executor_pb2.TokenIds(ids=prompt))
    if max_tokens is not None:
        request.sampling.max_tokens = max_tokens
    if k is not None:
        request.num_speculative_tokens = k
    return request
