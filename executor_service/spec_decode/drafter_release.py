"""Releasing requests from a drafter whose measured acceptance, or cost, rules drafting out (issue 31).

At adaptive speculation's k = 0 the drafter still follows every request, so that drafting can resume at any step:
each k = 0 step stages its feature rows in the held context's log (deferred_context.py), a flush runs the
drafter's context pass over them every DEFER_MAX steps, each admitted prompt runs the drafter's context pass, and
the scheduler reserves the drafter's lookahead slots. With a drafter that is never right that is all a k = 0 step
adds to a target-only one, and it is what kept the adaptive engine at 0.955x target-only at batch 64 on the H200.

So once the measured acceptance rules drafting out (every drafting candidate hopeless in AdaptiveK's sense: too
few accepted drafts to beat a k = 0 step anywhere, over at least MIN_VERIFIED verified request-steps; the global
acceptance, not a batch's: a release lasts the requests' lives and covers those admitted meanwhile), or the
measured costs do at the batch's size (`AdaptiveK.drafting_loses`: every drafting candidate measured there makes
fewer tokens a second than k = 0 at the global acceptance, over at least MIN_VERIFIED_COST request-steps; e.g.
the shipped DFlash drafter for SmolLM2 at batch 1 on an H200, whose k = 0 step with the drafter following cost
~1.0 ms against target-only's ~0.7), the engine stops following. At each step's plan, before the drafter runs
for the step:

- every request of the batch that the drafter follows is released: its held context is dropped and its own
  speculation set to none (no drafts, no lookahead slots), as for a request that asked for no drafts. It decodes
  target-only for the rest of its life, preempted or not: its drafter cache no longer follows its tokens. Drafts
  it already has are verified as usual (they were drafted from a complete cache);
- so a request admitted meanwhile is released at its first plan, before the drafter's pass over its prompt;
- a batch of which the drafter follows no request is planned at k = 0 without asking the cost model: its steps
  are target-only steps (the overlapped decode, nothing staged or proposed) and price k = 0 as such.

Retry, in case the traffic changed: after RETRY_STEPS steps planned with drafting ruled out (AdaptiveK's
MAX_REFRESH_STEPS, the longest interval at which it tests again a candidate it has given up on), the cost model
forgets its global acceptance. Drafting is then no longer ruled out (neither rule judges an acceptance never
observed), so requests admitted from then on are followed and drafted for, which measures the acceptance
afresh: still hopeless, or still losing on cost, once judged again, they are released too and the
clock starts again; otherwise the drafter is used as before. A retry costs those requests' prompt passes and their
speculative steps until the release is judged again (RELEASE_REQUESTS requests: at batch 1 on the H200, ~1,600
steps of DFlash at k = 3 in a round of 3,840, a round at 0.79x target-only). So a retry that finds drafting ruled out
again, within RETRY_STEPS steps of drafting, doubles the interval before the next (up to MAX_RETRY_BACKOFF times
RETRY_STEPS); one after which drafting paid for that long resets it. Requests released earlier stay released.
The costs are judged at the batch's size: requests released while the batch is small (batch 1, where a drafter can
lose) stay released if the load grows to a size where drafting wins or was never measured; the requests admitted
then are followed and drafted for, the released ones served beside them on the host path until they finish.

A drafter that is right, and pays for itself at the batch's size, is never released, and the choice of k for the
requests the drafter follows is the cost model's, unchanged. Greedy tokens never change (verification is exact). The
prefix cache registers blocks only for requests the drafter follows (engine.py, `_cache_prefixes`: one key stands
for the target's and the drafter's K/V): a released request's blocks registered before its release stay valid,
and it registers no more.
"""

from __future__ import annotations

from collections import Counter

from executor_service.engine.request import Request
from executor_service.spec_decode.adaptive_k import MAX_REFRESH_STEPS, MIN_JUDGED, AdaptiveK
from executor_service.spec_decode.deferred_context import DeferredContext

# Verified request-steps (AdaptiveK's decayed count at depth 1) before the acceptance may rule drafting out: a
# release lasts a request's life, so a few unlucky first verifications must not decide it (at batch 64, one step).
MIN_VERIFIED = 32
# Verified request-steps before the costs may rule drafting out at a batch's size: the cost model drafts at the
# configured k until it has seen as many (adaptive_k.MIN_JUDGED) and only then may choose k = 0 where drafting
# loses; the release makes those k = 0 steps target-only ones and lasts RETRY_STEPS, as long as the cost model's
# longest interval between checks. Fewer (8, before) released EAGLE-3 at batch 1 on ten unlucky first steps.
MIN_VERIFIED_COST = MIN_JUDGED
RETRY_STEPS = MAX_REFRESH_STEPS  # steps planned with drafting ruled out before it is tried again
MAX_RETRY_BACKOFF = 8  # retries that found drafting ruled out again stretch the interval up to 8 x RETRY_STEPS
MAX_RULINGS = 32  # rulings kept with their evidence (`describe`): the first ones, for benchmarks and logs


def follows_any(requests: list[Request]) -> bool:
    """Whether the drafter follows any of these requests (drafts for it, or keeps its cache for drafting): every
    request but those released or asking for no drafts."""
    return any(request.num_draft_tokens != 0 for request in requests)


class DrafterRelease:
    """The release and its retry clock; one per engine, on its thread. The acceptance it reads is the engine's
    current cost model's (a benchmark swaps models between traffics: the release follows the one in use)."""

    def __init__(
        self,
        deferred: DeferredContext | None,
        min_verified: float = MIN_VERIFIED,
        retry_steps: int = RETRY_STEPS,
        min_verified_cost: float = MIN_VERIFIED_COST,
    ) -> None:
        self.deferred, self.min_verified, self.retry_steps = deferred, min_verified, retry_steps
        self.min_verified_cost = min_verified_cost
        self.steps_ruled_out = 0  # steps planned since drafting was ruled out (0: not ruled out)
        self.backoff = 1  # the retry interval, in RETRY_STEPS: doubled by each retry that failed
        self.steps_since_retry: int | None = None  # steps with drafting not ruled out since the last retry
        self.counts: Counter[str] = Counter()  # "released" (requests), "retries", "ruled out by acceptance / cost"
        self.rulings: list[dict[str, object]] = []  # the first MAX_RULINGS rulings and what they stood on

    def followed(self, requests: list[Request], speculation: AdaptiveK) -> bool:
        """Once a step, before its next step is planned and the drafter runs for it: whether the drafter follows
        any of the batch's running `requests` after releasing them where drafting is ruled out, by the acceptance
        or by the costs at the batch's size (the module's docstring), or counting towards the retry."""
        ruled_out = speculation.drafting_ruled_out(self.min_verified)
        if not ruled_out and not speculation.drafting_loses(len(requests), self.min_verified_cost):
            self.steps_ruled_out = 0
            if self.steps_since_retry is not None:
                self.steps_since_retry += 1
            return follows_any(requests)
        if self.steps_ruled_out == 0:
            self._back_off()
            self._note_ruling("acceptance" if ruled_out else "cost", len(requests), speculation)
        self.steps_ruled_out += 1
        if self.steps_ruled_out >= self.retry_steps * self.backoff:
            self.steps_ruled_out = 0
            self.steps_since_retry = 0
            self.counts["retries"] += 1
            speculation.forget_acceptance()  # newly admitted requests are followed and drafted for again
            return follows_any(requests)
        for request in [r for r in requests if r.num_draft_tokens != 0]:
            self.release(request)
        return False

    def _back_off(self) -> None:
        """Drafting is ruled out anew: after a retry whose requests drafted fewer than RETRY_STEPS steps (it failed),
        the next retry waits twice as long (up to MAX_RETRY_BACKOFF times); after one that drafted for longer, or
        the first ruling, the base interval."""
        failed = self.steps_since_retry is not None and self.steps_since_retry < self.retry_steps
        self.backoff = min(2 * self.backoff, MAX_RETRY_BACKOFF) if failed else 1
        self.steps_since_retry = None

    def release(self, request: Request) -> None:
        """Stop following `request` for the rest of its life: no held context, no drafts, no lookahead slots."""
        request.num_draft_tokens = 0
        request.num_lookahead_tokens = 0
        if self.deferred is not None:
            self.deferred.drop(request)
        self.counts["released"] += 1

    def _note_ruling(self, rule: str, batch: int, speculation: AdaptiveK) -> None:
        """Drafting was ruled out (by the acceptance or by the costs at the batch's size): counted, and the first
        MAX_RULINGS kept with what they stood on, so a benchmark can tell why a drafter that wins was released."""
        self.counts[f"ruled out by {rule}"] += 1
        if len(self.rulings) >= MAX_RULINGS:
            return
        table = speculation.costs.get(AdaptiveK.bucket(batch), {})
        self.rulings.append({
            "rule": rule,
            "batch": batch,
            "plan": speculation.total_plans,
            "traffic_requests": speculation.traffic_requests,
            "expected_tokens": {k: round(speculation.expected_tokens(k), 3) for k in speculation.candidates},
            "step_ms": {k: round(cost.seconds * 1e3, 4) for k, cost in sorted(table.items())},
            "samples": {k: cost.samples for k, cost in sorted(table.items())},
        })  # fmt: skip

    def describe(self) -> dict[str, object]:
        """Its counts and rulings (benchmarks and logs), and after a retry the interval's backoff."""
        backoff = {"retry_backoff": self.backoff} if self.counts["retries"] else {}
        return {**dict(sorted(self.counts.items())), **backoff, "rulings": list(self.rulings)}
