"""What adaptive speculation (adaptive_k.py) knows of the drafts' acceptance: per verified request, how deep its
drafts went and how many were accepted (`observe_verify`), and what that makes a step at each k.

The acceptance rate per depth d (the share of steps that verified depth d whose accepted drafts reached it) is a
decayed count per request (adaptive_measures.py). The global rate is the traffic's: the mean of the last
TRAFFIC_REQUESTS requests' own shares (requests, whatever their ids: a caller may reuse one), each request weighing
the same (a rate over verify steps remembers ~200 request-steps: at batch 1 the last request or two). A request's
own rate is its counts shrunk towards the global rate as a prior of PRIOR steps, (reached + PRIOR x global) / (tried
+ PRIOR): mostly its own after a few dozen verify steps; before TRIAL_STEPS of them it counts as accepting every
draft, so each request is tried before it is judged (a request planned at k = 0 verifies nothing, so a prior alone
could keep it there for its life). `forget_request` drops a live request's counts when it finishes (the engine's
`_finish`: a stop, an abort, a failure; a preempted request keeps them, it is still live); the traffic keeps its
shares until TRAFFIC_REQUESTS newer requests push them out. The evidence counts (`evidence`: adaptive_k's `judged`,
the release's MIN_VERIFIED) are verify steps over all requests, decayed.

Per request because acceptance differs between the requests of one batch (greedy against sampled or penalised
requests: ~3.2 against ~1.4 tokens a step with the shipped SmolLM2 drafters), and the requests that accept most
finish first: a batch of 16 mixing them ended in a tail of two penalised requests, ~30 % of the wall time, that
kept paying a speculative step (~2.4x a decode step on a GPU) for ~1.4 tokens, planned on a global rate the greedy
requests' history still dominated. So the choice of k for a batch uses its own requests' rates.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

from executor_service.spec_decode.adaptive_measures import RequestAcceptance

# Requests whose own shares make the global acceptance rate (each weighing the same). Replayed at batch 1
# (bench/adaptive_replay.py), two penalised requests first released EAGLE-3 for every request after them (0.73x the
# fixed k) when the rate was counted over verify steps.
TRAFFIC_REQUESTS = 16


class AcceptanceModel:
    """The global and per-request acceptance per depth, and the expected tokens a step makes at each k; what is
    worked out of them is kept until they change (`version` counts the changes, for what others keep of it)."""

    def __init__(self, num_steps: dict[int, int]) -> None:
        """`num_steps`: the depth each candidate k's drafts reach (a chain's length, a tree's depth)."""
        self.num_steps = num_steps
        max_depth = max(num_steps.values(), default=0)
        self.reached = [0.0] * (max_depth + 1)  # decayed counts, index d: accepted drafts reached depth d
        self.tried = [0.0] * (max_depth + 1)  # index d: steps that verified depth d
        self.version = 0  # global acceptance changes so far
        self._expected: dict[int, float] = {}  # k -> expected_tokens(k), until the acceptance changes
        self._requests: dict[str, RequestAcceptance] = {}  # live requests' own counts, by id (forget_request)
        # the last TRAFFIC_REQUESTS requests verified, oldest first: their counts, not their ids (a caller may reuse
        # an id for its next request, as acceptance_bench did at batch 1; the traffic is still many requests)
        self._traffic: deque[RequestAcceptance] = deque(maxlen=TRAFFIC_REQUESTS)
        self._rates: list[float] | None = None  # the traffic's rate per depth, until the acceptance changes
        self._batch: tuple[tuple[object, ...], dict[int, float]] | None = None  # the last batch's expected tokens

    @property
    def depths(self) -> int:
        """The deepest depth a candidate's drafts reach."""
        return len(self.tried) - 1

    @property
    def evidence(self) -> float:
        """Verified request-steps seen (the decayed count at depth 1): what drafting is judged on."""
        return self.tried[1] if self.depths else 0.0

    def observe_verify(self, request_ids: Sequence[str], depths: Sequence[int], accepted: Sequence[int]) -> None:
        """Per verified request: its id, the depth its drafts reached and the drafts (the path's length) accepted.
        Counted in the global evidence and in the request's own counts (kept until `forget_request`; its shares in
        the traffic's rate until TRAFFIC_REQUESTS newer requests push them out)."""
        deepest = self.depths
        for request_id, depth, count in zip(request_ids, depths, accepted, strict=True):
            own = self._requests.get(request_id)
            if own is None:
                own = self._requests[request_id] = RequestAcceptance.fresh(len(self.tried))
                self._traffic.append(own)
            own.observe(min(depth, deepest), count, self.tried, self.reached)
        self._changed()

    @property
    def tracked_requests(self) -> int:
        """The requests with counts of their own: live ones only (the engine forgets a request as it finishes)."""
        return len(self._requests)

    def forget_request(self, request_id: str) -> None:
        """The request finished (or was aborted or failed): its own counts go (the global evidence keeps them, and the
        traffic's rate its shares until pushed out)."""
        if self._requests.pop(request_id, None) is not None:
            self._batch = None

    def forget(self) -> None:
        """Start the global acceptance afresh (unobserved: 1.0, so drafting is tried again before it is judged).
        The requests' own counts stay: they are still their evidence (a released request verifies no more)."""
        self.reached = [0.0] * len(self.reached)
        self.tried = [0.0] * len(self.tried)
        self._traffic.clear()
        self._changed()

    def acceptance(self, depth: int, request_id: str | None = None) -> float:
        """The share of verify steps reaching `depth` whose accepted drafts reached it: the traffic's (the global
        rate: the mean of the last TRAFFIC_REQUESTS requests' own shares; 1.0 until observed, so drafting is tried
        before it is judged), or `request_id`'s: 1.0 while it is on trial (fewer than TRIAL_STEPS verify steps of its
        own), then its own shrunk towards the global rate as a prior of PRIOR steps, (reached + PRIOR x global) /
        (tried + PRIOR), mostly its own after a few dozen verify steps."""
        rate = self._traffic_rates()[depth]
        if request_id is None:
            return rate
        own = self._requests.get(request_id)
        return 1.0 if own is None or own.on_trial else own.own[depth] + rate * own.weight[depth]

    def _traffic_rates(self) -> list[float]:
        """Per depth, the mean of the traffic's requests' own shares (those that verified that depth), each request
        weighing the same: at batch 1 the verify steps of the last request or two are all a step-weighted rate
        would remember (~200 request-steps), and one request whose drafts are rarely accepted (a repetition
        penalty) then set every newcomer's prior and released the drafter for the requests after it."""
        if self._rates is None:
            self._rates = [1.0] * len(self.tried)
            for d in range(1, len(self.tried)):
                shares = [a.reached[d] / a.tried[d] for a in self._traffic if a.tried[d] > 0]
                self._rates[d] = math.fsum(shares) / len(shares) if shares else 1.0
        return self._rates

    @property
    def traffic_requests(self) -> int:
        """Requests the traffic's rate stands on (the release rules ask for RELEASE_REQUESTS of them)."""
        return len(self._traffic)

    def expected_tokens(self, num_draft_tokens: int, request_ids: Sequence[str] | None = None) -> float:
        """Tokens a request emits per step at `num_draft_tokens`: the bonus token and each depth's chance to be
        reached (a depth is reached only if the one before it was: the rates are each depth's own share). At the
        global rates, or (`request_ids`) the mean over these requests at their own (`acceptance`). Kept until the
        acceptance changes (`observe_verify`): a plan reads it for every candidate."""
        if request_ids is not None:
            return self.batch_expected(request_ids)[num_draft_tokens]
        found = self._expected.get(num_draft_tokens)
        if found is None:
            depths = range(1, self.num_steps[num_draft_tokens] + 1)
            found = self._expected[num_draft_tokens] = 1.0 + sum(self.acceptance(d) for d in depths)
        return found

    def batch_expected(self, request_ids: Sequence[str], undrafted: int = 0) -> dict[int, float]:
        """k -> the mean expected tokens per step of these requests at their own rates (none: the global rates), in
        a batch with `undrafted` more requests that make one token a step at any k. Per depth the sum of their rates
        is sum(own) + global x sum(weight) + 1 for each request on trial (or without history), each request's parts
        worked out when its counts changed (RequestAcceptance): a plan adds up a few floats per request, in C, and
        not even that while neither the batch nor any count changed (k = 0 steps)."""
        if not request_ids:
            if undrafted:  # none of the batch drafts: one token a step whatever k
                return dict.fromkeys(self.num_steps, 1.0)
            return {k: self.expected_tokens(k) for k in self.num_steps}
        key = (*request_ids, undrafted)
        if self._batch is not None and self._batch[0] == key:
            return self._batch[1]
        known = [own for rid in request_ids if (own := self._requests.get(rid)) is not None and not own.on_trial]
        depths, on_trial = len(self.tried), len(request_ids) - len(known)  # on trial: every draft accepted
        own = [math.fsum(d) for d in zip(*(a.own for a in known), strict=True)] if known else [0.0] * depths
        weight = [math.fsum(d) for d in zip(*(a.weight for a in known), strict=True)] if known else [0.0] * depths
        rates = [0.0] + [own[d] + self.acceptance(d) * weight[d] + on_trial for d in range(1, depths)]
        reached = list(itertools.accumulate(rates))  # index d: the sum of the rates up to depth d
        batch = len(request_ids) + undrafted  # the undrafted requests make one token a step at any k
        expected = {k: 1.0 + reached[steps] / batch for k, steps in self.num_steps.items()}
        self._batch = (key, expected)
        return expected

    def _changed(self) -> None:
        """Drop what was worked out of the global acceptance: expected tokens, the last batch's, the rates."""
        self.version += 1
        self._expected.clear()
        self._batch = None
        self._rates = None
