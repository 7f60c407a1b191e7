"""Adaptive speculation plans for the acceptance of the requests in the batch (adaptive_k.py, issue 31), in the
engine on the CPU: a batch whose drafts are always right for some requests and always wrong for the others drafts
while the right ones run, and once they finish the wrong ones left are stepped without drafting; greedy tokens
are target-only's throughout, and no request's counts outlive it (finished or aborted). Negative control: the same
run planned on the global acceptance alone keeps drafting for the tail."""

from __future__ import annotations

import pytest
from engine_driving import Collector, run_bounded
from executor_builders import greedy
from greedy_reference import greedy_reference
from spec_builders import Priced, ReplayDrafts, spec_session
from spec_checks import assert_no_leak, prompts

from executor_service.engine.request import Request
from executor_service.spec_decode import adaptive_k

K = 3
PRICES = {0: 0.010, K: 0.025}  # seconds per step: a speculative step at k = 3 costs 2.5 decode steps
RIGHT, WRONG = 6, 2
RIGHT_TOKENS, WRONG_TOKENS = 16, 48
SETTLING = 4  # tail steps that may still draft, before the wrong requests' own rate is mostly their own
CHECKING = adaptive_k.CONFIRMING_CHECKS * (adaptive_k.CHECK_STEPS + 1)  # steps the checks confirming k = 0 draft


def mixed_run(global_only: bool = False, abort: bool = False) -> tuple[Priced, dict[str, Request]]:
    """RIGHT requests whose drafts are the target's own next tokens (all accepted) and WRONG requests whose first
    draft is corrupted (none accepted), greedy, batched; the wrong ones generate longer. `abort`: one more wrong
    request, aborted midway. Returns the cost model and the requests; checks the tokens and that nothing leaks."""
    session = spec_session("eagle3", K, max_num_batched_tokens=256)
    speculation = session.engine.speculation = Priced(PRICES, global_only)
    model = session.loaded.model
    proposer = session.proposer
    assert proposer is not None
    kinds = ["right"] * RIGHT + ["wrong"] * (WRONG + abort)
    texts = prompts(len(kinds), seed=12).values()
    batch = {f"{kind}{i}": prompt for i, (kind, prompt) in enumerate(zip(kinds, texts, strict=True))}
    lengths = {rid: RIGHT_TOKENS if rid.startswith("right") else WRONG_TOKENS for rid in batch}
    references = {rid: greedy_reference(model, prompt, lengths[rid] + K + 1) for rid, prompt in batch.items()}
    vocab = model.config.vocab_size
    right, wrong = ReplayDrafts(references, vocab), ReplayDrafts(references, vocab, wrong_at=0)
    proposer.replay = lambda request, drafts: (right if request.request_id.startswith("right") else wrong)(
        request, drafts
    )
    sink, requests = Collector(), {}
    for rid, prompt in batch.items():
        requests[rid] = session.new_request(rid, prompt, greedy(lengths[rid]), lengths[rid], sink)
        session.engine.add(requests[rid])
    session.engine._drain_commands()
    gone = requests.pop(f"wrong{RIGHT + WRONG}") if abort else None
    for _ in range(8):
        session.engine.step()
    if gone is not None:
        assert speculation.acceptance(1, gone.request_id) != speculation.acceptance(1)  # counts of its own
        assert session.engine.abort([gone.request_id]) == [gone.request_id]
    run_bounded(session.engine)
    for rid, request in requests.items():
        assert sink.tokens(rid) == references[rid][: request.max_tokens], rid
    assert_no_leak(session)  # no request's own counts left: finished, and aborted
    return speculation, requests


def drafting_steps(speculation: Priced, requests: dict[str, Request]) -> int:
    """Steps the batch drafts for before its tail can run without drafting: while right requests run, or before
    drafting can be judged (MIN_JUDGED verify steps)."""
    right_steps = max(r.verify_steps for r in requests.values() if r.request_id.startswith("right"))
    return max(right_steps, sum(not judged for _, _, judged in speculation.planned))


def tail_plans(speculation: Priced) -> list[int]:
    """The k of each plan made once every right request had finished (a batch of wrong requests only) and enough
    verify steps were seen to judge drafting (adaptive_k.MIN_JUDGED: before, the configured k is planned)."""
    return [
        k for ids, k, judged in speculation.planned if ids and judged and all(rid.startswith("wrong") for rid in ids)
    ]


@pytest.mark.parametrize("abort", [False, True], ids=["finished", "one-aborted"])
def test_the_tail_of_always_wrong_requests_runs_without_drafting(abort: bool) -> None:
    """While the right requests run the batch drafts (their ~4 tokens a step pay for 2.5 decode steps' time); once
    they finish (and MIN_JUDGED verify steps were seen), the wrong ones left are planned at k = 0 as soon as their
    own failures outweigh the global rate in their own (PRIOR pseudo-steps of the traffic's rate, which still counts
    the right requests: they had ~5 verify steps of their own by then, so at most SETTLING more steps draft); after
    that only the checks that confirm k = 3's loss
    (CONFIRMING_CHECKS, each of about CHECK_STEPS + 1 steps) draft, and they accept nothing."""
    speculation, requests = mixed_run(abort=abort)
    mixed = [k for ids, k, _ in speculation.planned if any(rid.startswith("right") for rid in ids)]
    tail = tail_plans(speculation)
    assert mixed.count(K) >= len(mixed) - 1 and len(tail) >= 20
    assert tail[SETTLING:].count(K) <= CHECKING and tail[SETTLING : SETTLING + 8] == [0] * 8
    assert speculation.chosen[0] >= len(tail) - SETTLING - CHECKING
    for request in requests.values():
        assert request.verify_steps > 0
        if request.request_id.startswith("right"):
            assert request.accepted_tokens == request.drafted_tokens
        else:
            drafted = drafting_steps(speculation, requests) + SETTLING + CHECKING
            assert request.accepted_tokens == 0 and request.verify_steps <= drafted + 1


def test_the_tail_check_fails_on_the_global_acceptance() -> None:
    """Negative control: planned on the global acceptance, which the right requests' history dominates, the tail
    keeps drafting (until its own failures drag the global rate down)."""
    speculation, requests = mixed_run(global_only=True)
    assert tail_plans(speculation)[:3] == [K] * 3
    drafted = drafting_steps(speculation, requests)
    assert all(r.verify_steps > drafted + 1 for r in requests.values() if r.request_id.startswith("wrong"))
