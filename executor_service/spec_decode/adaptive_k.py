"""Adaptive speculation: per step, how many drafts the batch verifies next (k), or none at all (k = 0).

k here is always num_draft_tokens, the drafts verified per step (docs/executor.md, the numbers of speculation):
a chain's length, a tree's node count; each candidate's drafts reach its num_steps (a chain's length, a tree's
depth), which is what the acceptance per depth prices.

Drafting pays while the target verifies k + 1 rows per request for about the price of one; at high batch the
verify rows are no longer free (the pass becomes compute bound, or the speculative step runs eagerly past its
graphs' batch) and a plain decode step gives more tokens per second. The engine asks `plan(request_ids)` (the
batch's running requests) after each step for the next step's k and tells this model what it measured:

- `record(batch, k, seconds)`: the wall time of a steady step (it verified k drafts per request and drafted k for
  the next one; k = 0: a target decode step, the drafter's context held for later, deferred_context.py). Per
  (batch bucket, k), the median of the last few steady steps after a first one left out as a warm-up: the
  drafter's and the target's times together, measured as served, on the device or the CPU alike. A median, not
  a moving average: on a GPU a step that compiles a kernel for a new shape takes a hundred times longer, and an
  average seeded by it kept a winning k priced out (seen on the H100 at batch 64: 202 ms for a 44 ms step).
- `record_deferred(batch, seconds, steps, landed)`: a flush of the drafter's held context at k = 0 (once in
  about DEFER_MAX steps): the time it added to the steps it landed in, beyond plain k = 0 steps, spread over
  the k = 0 steps whose rows it ran. k = 0's price is its median plus the median of these surcharges, so
  neither the median (which would outvote the rare flush) nor a flush step taken as a plain sample misprices it.
- `observe_verify(request_ids, depths, accepted)`: per verified request, how deep its drafts went and how many were
  accepted: the acceptance per depth, the traffic's and each request's own (acceptance_model.py).

The choice of k for a batch uses its own requests' rates: acceptance differs between the requests of one batch
(greedy against sampled or penalised), and the requests that accept most finish first.

Until MIN_JUDGED verified request-steps are seen (the global count; again after `forget_acceptance`), every bucket
exploits the configured k: a few first steps' acceptance is too noisy to judge drafting on, and k = 0 chosen on it
stays chosen (drafting is then checked only now and then) and, where it loses on cost, releases the requests.

The choice maximises the batch's expected tokens per second, the sum over its requests of `1 + the sum of their
rates up to num_steps(k)` over the step's measured time at the batch's bucket (a power of two of the batch size),
over the candidates (the k values with captured graphs: no capture at run time). A candidate not yet measured at
a bucket is tried first (the configured k, then 0, then the rest), for a few steps; a losing one is measured
again after a while (its acceptance may have changed), each time later (a doubled interval) while it keeps
losing, so a batch whose best k is clear pays almost nothing for the check. A check measures the candidate afresh
(its CHECK_SAMPLES samples replace its window). The interval is never shorter
than what keeps the checks to about EXPLORE_SHARE of the bucket's time (a check runs about CHECK_STEPS steps at the
loser's price: at high batch a speculative step can cost several plain ones), and it is the longest one
(MAX_REFRESH_STEPS) for a candidate that could not win with every draft accepted (`batch x (1 + num_steps)` over its
measured time below the incumbent's expected throughput and its margin), unless that candidate is k = 0 priced at or
above the drafting incumbent: the least work a step does cannot cost more, so its samples met a stall, and it is
checked at its refresh interval (`_doubted`).

Prices are compared as measured at about the same moment. The incumbent is priced every step it runs, the others
only when checked, and the machine has slow moments (a stall of the host or the device: another process, a long
collection), so: a bucket leaves its incumbent only for a candidate priced in its last FRESH_STEPS plans, else
that candidate is checked first; and the candidate it leaves is checked again FRESH_STEPS later, and once more
after, until CONFIRMING_CHECKS checks in a row find it losing or it wins back (`recheck`). Only a loss so confirmed
counts for the release on cost (`drafting_loses`): a release lasts thousands of steps. Replayed on recorded
acceptance with simulated stalls (bench/adaptive_replay.py), 10 of 40 cases where EAGLE-3 drafting wins were more
than 5 % below the fixed k (24 before, down to 0.71x), and none with the traffic's rate and each request's trial
(above): 0.996-1.04x in all 40.

A drafting k whose measured acceptance adds too
few tokens to win anywhere is not tested at a bucket that never measured it (`_hopeless`; a bucket a round passes
through once would pay a speculative step in every round), and a test the batch left for more than
MAX_EXPLORE_STEPS steps elsewhere is dropped, to be retried later. The choice of k, the judging of a test and the
check intervals read the batch's acceptance (the step and its checks are this batch's); what outlasts the batch
reads the global one: `_hopeless` (a test skipped at a bucket for MAX_REFRESH_STEPS, `measured`) and
`drafting_ruled_out`. The choice is a function of these measurements, the batch's requests and the step count
alone (deterministic given the costs), and it changes no token: greedy verification is exact whatever k. Where the
measured global acceptance rules every drafting k out (`drafting_ruled_out`), the engine releases requests from
the drafter and plans their steps at k = 0 without this model, until a retry forgets the global acceptance
(`forget_acceptance`; drafter_release.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from executor_service.spec_decode.acceptance_model import AcceptanceModel
from executor_service.spec_decode.adaptive_measures import WINDOW, StepCost

MIN_SAMPLES = 3  # steady steps that measure a candidate before it is compared (a median of 3 outvotes one outlier)
MAX_EXPLORE_STEPS = 6  # a candidate under test is given up after this many steps without enough steady samples
REFRESH_STEPS = 128  # steps at a bucket before a losing candidate is measured again; doubled while it loses
MAX_REFRESH_STEPS = 8192
HYSTERESIS = 0.03  # another k must beat the current one by this share to replace it (no flapping on noise)
EXPLORE_SHARE = 0.01  # checks of a losing candidate cost about this share of a bucket's time, at most
# Steady samples a check of a measured candidate collects: a majority of its window, so its price is what the check
# measured, not what it was when it last lost (with one sample a stall that priced it out kept it out for checks at
# doubling intervals).
CHECK_SAMPLES = MIN_SAMPLES
CHECK_STEPS = CHECK_SAMPLES + 1  # steps a check runs at about the candidate's price (drafted for, verified..., back)
# A bucket leaves the k it exploits only for a candidate priced in the last FRESH_STEPS plans there; one priced
# longer ago is checked first. The incumbent is priced every step, the others now and then: on the shared H200 host
# k = 3's median at batch 1 rose from 1.10 to 1.42 ms in one round (slow moments of the machine) over a k = 0 price
# measured long before, and the bucket went over to k = 0 on a comparison of two moments (546 of 2,294 steps, T = 0.7).
FRESH_STEPS = 2 * WINDOW
# Checks in a row, FRESH_STEPS apart, of a k the bucket left: its loss is confirmed (or it wins back) before the costs
# may release requests from the drafter (drafter_release.py: a release lasts thousands of steps, and a check of
# three steps can meet a stall too).
CONFIRMING_CHECKS = 2
# Verified request-steps (the decayed count at depth 1) before drafting is judged on its acceptance: until then a
# bucket exploits the configured k. At batch 1 on the H200, EAGLE-3's first 10 verify steps at T = 0.7 accepted
# [0.20, 0, 0] by depth where its run averaged 0.9 drafts a step, and k = 0 chosen on them lost 21 % for the run.
MIN_JUDGED = 32
# Requests in the traffic (acceptance_model.TRAFFIC_REQUESTS) before the release from the drafter may be judged on
# it: the release lasts thousands of steps and covers the requests admitted meanwhile.
RELEASE_REQUESTS = 4

PlanObserver = Callable[[int], None]  # each planned step's k (metrics)


@dataclass
class Exploration:
    num_draft_tokens: int
    until_samples: int
    steps_left: int
    last_plan: int  # AdaptiveK.total_plans at its latest step: a test left for long elsewhere is dropped


class AdaptiveK:
    """The cost model and the choice of k; one per engine, driven by the engine thread alone."""

    def __init__(
        self, candidates: Iterable[int], num_steps: dict[int, int] | None = None, configured: int | None = None
    ) -> None:
        """`candidates`: the num_draft_tokens values a step may take (0: no drafting); `num_steps`: the depth each
        one's drafts reach (a tree's depth), default the value itself (a chain's); `configured`: the loaded
        drafter's num_draft_tokens, tried first."""
        self.candidates = sorted(set(candidates))
        if not self.candidates or self.candidates[0] < 0:
            raise ValueError(f"candidates must be k >= 0, got {self.candidates}")
        self.num_steps = {k: k for k in self.candidates} | (num_steps or {})
        self.configured = configured if configured is not None else self.candidates[-1]
        self.costs: dict[int, dict[int, StepCost]] = {}  # bucket -> k -> cost
        self.plans: Counter[int] = Counter()  # bucket -> steps planned there
        self.total_plans = 0
        self.chosen: Counter[int] = Counter()  # k -> steps planned with it (stats and metrics)
        self.last_planned: int | None = None  # the latest plan's num_draft_tokens (the speculative_k metric)
        self.observer: PlanObserver | None = None
        self._current: dict[int, int] = {}  # bucket -> the k it exploits
        self._exploring: dict[int, Exploration] = {}
        self._retry_at: dict[tuple[int, int], int] = {}  # (bucket, k) given up unmeasured -> plan count to retry
        self.accepted = AcceptanceModel(self.num_steps)
        # `_every_drafting_k_hopeless` at an acceptance version (it is asked every step of a released batch)
        self._all_hopeless: tuple[int, bool] | None = None

    @staticmethod
    def bucket(batch: int) -> int:
        """Batches share a cost table per power of two (step times move little within one)."""
        return 1 << max(batch - 1, 0).bit_length()

    # ---- what the engine measured --------------------------------------------------------------
    def record(self, batch: int, num_draft_tokens: int, seconds: float) -> None:
        """A steady step's wall time: it verified `num_draft_tokens` drafts per request and drafted as many for
        the next step."""
        if num_draft_tokens not in self.num_steps or seconds <= 0:
            return
        bucket = self.bucket(batch)
        table = self.costs.setdefault(bucket, {})
        cost = table.get(num_draft_tokens)
        if cost is None:
            table[num_draft_tokens] = StepCost(
                seconds, measured_at=self.plans[bucket], sampled_at=self.plans[bucket], refresh=REFRESH_STEPS
            )
            return
        cost.add(seconds, self.plans[bucket])

    def record_deferred(self, batch: int, seconds: float, steps: int, landed: int) -> None:
        """A flush of the drafter's context held over `steps` k = 0 steps, which landed in `landed` steady k = 0
        steps that took `seconds` together: their time beyond as many plain k = 0 steps, per step it served, is
        part of k = 0's price (before k = 0 is measured at the bucket, nothing to compare with: ignored; the first
        flush after, a warm-up, too)."""
        cost = self.costs.get(self.bucket(batch), {}).get(0)
        if cost is None or steps <= 0:
            return
        if not cost.flushed:  # a warm-up, as a first plain step is: on the H100 the first flush of 64 requests'
            cost.flushed = True  # rows compiled kernels for its row count and priced k = 0 at 112 ms, not 9
            return
        cost.add_surcharge(max(seconds - landed * cost.plain, 0.0) / steps)

    def observe_verify(self, request_ids: Sequence[str], depths: Sequence[int], accepted: Sequence[int]) -> None:
        """Per verified request: its id, the depth its drafts reached and the drafts accepted (AcceptanceModel)."""
        self.accepted.observe_verify(request_ids, depths, accepted)

    @property
    def tracked_requests(self) -> int:
        """The requests with counts of their own: live ones only (the engine forgets a request as it finishes)."""
        return self.accepted.tracked_requests

    def forget_request(self, request_id: str) -> None:
        """The request finished (or was aborted or failed): its own counts go."""
        self.accepted.forget_request(request_id)

    def acceptance(self, depth: int, request_id: str | None = None) -> float:
        """The traffic's acceptance at `depth`, or `request_id`'s own (AcceptanceModel.acceptance)."""
        return self.accepted.acceptance(depth, request_id)

    @property
    def traffic_requests(self) -> int:
        """Requests the traffic's rate stands on (the release rules ask for RELEASE_REQUESTS of them)."""
        return self.accepted.traffic_requests

    def expected_tokens(self, num_draft_tokens: int, request_ids: Sequence[str] | None = None) -> float:
        """Tokens a request emits per step at `num_draft_tokens`, at the global rates or (`request_ids`) the mean over
        these requests at their own (AcceptanceModel.expected_tokens)."""
        return self.accepted.expected_tokens(num_draft_tokens, request_ids)

    def throughput(self, request_ids: Sequence[str], num_draft_tokens: int) -> float | None:
        """Expected tokens per second at `num_draft_tokens` for the batch of these requests (at their own rates),
        or None where its step time is not measured (no requests: a batch of one at the global rates, as `plan`)."""
        batch = max(len(request_ids), 1)
        cost = self.costs.get(self.bucket(batch), {}).get(num_draft_tokens)
        if cost is None:
            return None
        return batch * self.expected_tokens(num_draft_tokens, request_ids) / cost.seconds

    # ---- the choice --------------------------------------------------------------------------------
    def plan(self, request_ids: Sequence[str], undrafted: int = 0) -> int:
        """The k of the next step for the batch of these requests (none: a batch of one at the global rates): a
        candidate under test, else the best measured one at the batch's bucket for these requests' own acceptance
        (`acceptance`): a batch's tail of requests whose drafts are rarely accepted is planned for them, not for
        the requests that finished before them. `undrafted`: the batch's other requests, which draft nothing (they
        asked for none, or were released from the drafter): one token a step at any k, in the batch's size."""
        bucket = self.bucket(len(request_ids) + undrafted)
        self.plans[bucket] += 1
        self.total_plans += 1
        expected = self.accepted.batch_expected(request_ids, undrafted)
        k = self._explore(bucket, expected)
        if k is None:
            k = self._best(bucket, expected)
        self.count_plan(k)
        return k

    def count_plan(self, num_draft_tokens: int) -> None:
        """A step planned at `num_draft_tokens`, for the stats and metrics; the engine also counts here the k = 0 of a
        step it planned without a choice (none of its requests drafts: drafter_release.py)."""
        self.chosen[num_draft_tokens] += 1
        self.last_planned = num_draft_tokens
        if self.observer is not None:
            self.observer(num_draft_tokens)

    def drafting_ruled_out(self, min_verified: float) -> bool:
        """Whether the measured acceptance, over at least `min_verified` verified request-steps (decayed), rules
        every drafting candidate out (`_hopeless`): the engine then stops following requests with the drafter
        (drafter_release.py). The global acceptance: a release lasts the requests' lives and covers the requests
        admitted meanwhile, so it is judged on the traffic, not on one batch."""
        return self._every_drafting_k_hopeless() and self._release_evidence(min_verified)

    def _release_evidence(self, min_verified: float) -> bool:
        """Whether the acceptance stands on enough to release requests from the drafter: `min_verified` verified
        request-steps (decayed) and RELEASE_REQUESTS requests in the traffic (a release covers those to come)."""
        return self.accepted.evidence >= min_verified and self.traffic_requests >= RELEASE_REQUESTS

    def _every_drafting_k_hopeless(self) -> bool:
        """Whether there is a drafting candidate and every one is `_hopeless`; kept until the acceptance changes (it
        is asked every step of a batch released from the drafter)."""
        version = self.accepted.version
        if self._all_hopeless is None or self._all_hopeless[0] != version:
            drafting = [k for k in self.candidates if k > 0]
            self._all_hopeless = (version, bool(drafting) and all(self._hopeless(k) for k in drafting))
        return self._all_hopeless[1]

    def drafting_loses(self, batch: int, min_verified: float) -> bool:
        """Whether, at the bucket of a batch of `batch` requests, the measured step prices and the global acceptance
        (over at least `min_verified` verified request-steps, decayed) leave no drafting candidate that beats k = 0:
        each measured one makes fewer tokens a second, the others are hopeless. k = 0's price there was paid with
        the drafter following the requests (held context, flushes, bookkeeping), more than a step of requests
        released from it costs, so a drafting k that loses to it loses to target-only decoding too. The engine then
        stops following requests, as where the acceptance rules drafting out (drafter_release.py). The global
        acceptance: a release lasts the requests' lives, so it is judged on the traffic, not on one batch."""
        bucket = self.bucket(batch)
        if not self._release_evidence(min_verified) or self._current.get(bucket) != 0:  # the bucket chose k = 0
            return False
        table = self.costs.get(bucket, {})
        zero = table.get(0)
        if zero is None or zero.samples < MIN_SAMPLES:
            return False
        for k in self.candidates:
            if k == 0 or self._hopeless(k):
                continue
            cost = table.get(k)
            if cost is None or cost.samples < MIN_SAMPLES or self.expected_tokens(k) / cost.seconds >= 1 / zero.seconds:
                return False
            if not self._confirmed_loser(bucket, k, cost):
                return False
        return True

    def _confirmed_loser(self, bucket: int, num_draft_tokens: int, cost: StepCost) -> bool:
        """Whether CONFIRMING_CHECKS checks in a row since the bucket left this candidate found it losing, and none
        is under way: its price measured beside the incumbent's, not in one moment of the machine (a stall that
        raised its price while it ran could have made the bucket leave it)."""
        exploring = self._exploring.get(bucket)
        checking = exploring is not None and exploring.num_draft_tokens == num_draft_tokens
        return cost.lost_checks >= CONFIRMING_CHECKS and not checking

    def forget_acceptance(self) -> None:
        """Start the global acceptance afresh (unobserved: 1.0, so drafting is tried again before it is judged):
        the drafter's retry after a long release (drafter_release.py), in case the traffic changed. The requests'
        own counts stay: they are still their evidence (a released request verifies no more)."""
        self.accepted.forget()

    def _order(self) -> list[int]:
        """Candidates in the order they are first tried: the configured k, no drafting, then the rest, largest first."""
        first = [k for k in (self.configured, 0) if k in self.num_steps and k in self.candidates]
        return first + [k for k in reversed(self.candidates) if k not in first]

    def _explore(self, bucket: int, expected: dict[int, float]) -> int | None:
        """A candidate to test at the bucket (not yet measured, or stale), or None. Which candidates are skipped
        as hopeless is decided on the global acceptance (the skip lasts MAX_REFRESH_STEPS at the bucket, beyond
        this batch); when a test ends it is judged, and the intervals set, for this batch (`expected`)."""
        table = self.costs.setdefault(bucket, {})
        exploring = self._exploring.get(bucket)
        if exploring is not None:
            cost = table.get(exploring.num_draft_tokens)
            away = self.total_plans - 1 - exploring.last_plan > MAX_EXPLORE_STEPS  # batches passing through
            if (cost.samples if cost else 0) < exploring.until_samples and exploring.steps_left > 0 and not away:
                exploring.steps_left -= 1
                exploring.last_plan = self.total_plans
                return exploring.num_draft_tokens
            del self._exploring[bucket]
            if (cost.samples if cost else 0) < exploring.until_samples:  # no steady step came: not before a while
                self._retry_at[bucket, exploring.num_draft_tokens] = self.plans[bucket] + REFRESH_STEPS
            self._judge(bucket, exploring.num_draft_tokens, expected)
        for k in self._order():
            cost = table.get(k)
            samples = cost.samples if cost is not None else 0
            if self.plans[bucket] < self._retry_at.get((bucket, k), 0):
                continue
            if samples < MIN_SAMPLES and self._hopeless(k):  # tried now and then, in case the traffic changed
                self._retry_at[bucket, k] = self.plans[bucket] + MAX_REFRESH_STEPS
                continue
            stale = cost is not None and k != self._current.get(bucket) and self._due(bucket, k, cost, expected)
            if samples < MIN_SAMPLES or stale:
                if cost is not None and samples >= MIN_SAMPLES:
                    cost.measured_at = self.plans[bucket]  # tried now: not stale again before its interval
                self._check(bucket, k, samples)
                return k
        return None

    def _check(self, bucket: int, num_draft_tokens: int, samples: int) -> None:
        """Test a candidate at the bucket from this plan on, until CHECK_SAMPLES more steady samples (MIN_SAMPLES
        for an unmeasured one) or MAX_EXPLORE_STEPS steps."""
        cost = self.costs[bucket].get(num_draft_tokens)
        if cost is not None and samples >= MIN_SAMPLES:
            cost.restart()
        wanted = samples + (MIN_SAMPLES if samples < MIN_SAMPLES else CHECK_SAMPLES)
        self._exploring[bucket] = Exploration(num_draft_tokens, wanted, MAX_EXPLORE_STEPS - 1, self.total_plans)

    def _hopeless(self, num_draft_tokens: int) -> bool:
        """Whether the measured acceptance says a drafting k adds too few tokens to win anywhere: a speculative step
        costs at least a k = 0 step (the same target pass, more rows, and the drafter's), so k cannot beat it by
        HYSTERESIS unless it makes that many more tokens a step. Such a k is not tested at a bucket that never
        measured it (a batch size a round passes through once: the H200 paid a 23 ms step for a 7 ms one in every
        round); where it is measured, its checks keep the acceptance current. The global acceptance: it decides
        for the traffic (tests skipped for long, `measured`, the drafter's release), not for one batch."""
        return self._adds_too_little(num_draft_tokens, self.expected_tokens(num_draft_tokens))

    def _adds_too_little(self, num_draft_tokens: int, expected: float) -> bool:
        """Whether drafts expected to make `expected` tokens a step (acceptance observed) cannot beat k = 0."""
        return num_draft_tokens > 0 and self.accepted.evidence > 0 and expected < 1 + HYSTERESIS

    def _due(self, bucket: int, num_draft_tokens: int, cost: StepCost, expected: dict[int, float]) -> bool:
        """Whether a measured candidate the bucket does not exploit is due a check: FRESH_STEPS after the bucket
        left it (`recheck`: the price it was left on may be a stall's), else at its interval."""
        since = self.plans[bucket] - cost.measured_at
        if cost.recheck:
            return since > FRESH_STEPS
        return since > cost.refresh and since > self._interval(bucket, num_draft_tokens, cost, expected)

    def _interval(self, bucket: int, num_draft_tokens: int, cost: StepCost, expected: dict[int, float]) -> int:
        """Plans at the bucket between checks of a measured candidate the bucket does not exploit, never fewer
        than its `refresh` (doubled while it loses): that interval, stretched so the checks cost at most
        EXPLORE_SHARE of the time (a check loses, over CHECK_STEPS steps at its price, the tokens the incumbent
        would have made meanwhile), and the longest where it could not replace the incumbent even with every draft
        accepted (only a changed cost could make it win: its own, measured again then, or the incumbent's,
        measured every step it runs). Tokens per step are this batch's (`expected`): the check is paid by it."""
        current = self._current.get(bucket)
        incumbent = self.costs[bucket].get(current) if current is not None else None
        if incumbent is None or incumbent.samples < MIN_SAMPLES or cost.samples < MIN_SAMPLES:
            return cost.refresh
        if self._doubted(bucket, num_draft_tokens, cost):
            return cost.refresh
        rate = expected[current] / incumbent.seconds  # per request and second
        best_case = (1 + self.num_steps[num_draft_tokens]) / cost.seconds
        if best_case < rate * (1 + HYSTERESIS):
            return MAX_REFRESH_STEPS
        share = expected[num_draft_tokens] / cost.seconds / rate  # of the incumbent's throughput
        lost = CHECK_STEPS * cost.seconds * max(0.0, 1.0 - share)
        return min(max(cost.refresh, math.ceil(lost / (EXPLORE_SHARE * incumbent.seconds))), MAX_REFRESH_STEPS)

    def _doubted(self, bucket: int, num_draft_tokens: int, cost: StepCost) -> bool:
        """Whether k = 0 is priced at or above the drafting k the bucket exploits. A k = 0 step is the least work a
        step does (the target's decode pass; nothing drafted, the drafter's context held), so such a price was
        measured in a bad moment: a stall of the host or the device over most of its recent samples (another
        process, a long collection; seen on the shared CPU host), which moved the median. Taken at its word, k = 0
        could not win and would be checked only at the longest interval (8192 steps of the losing k, each several
        k = 0 steps' time); doubted, it is checked at its refresh interval (doubled while it loses, so a k = 0 truly
        this dear, its flushes of held context included, is checked less and less often), measured afresh as every
        check is, so the stall's samples no longer set the price."""
        current = self._current.get(bucket)
        if num_draft_tokens != 0 or not current:
            return False
        incumbent = self.costs[bucket].get(current)
        return incumbent is not None and cost.seconds >= incumbent.seconds

    def _judge(self, bucket: int, num_draft_tokens: int, expected: dict[int, float]) -> None:
        """After a test: a candidate that still loses (for this batch's acceptance, `expected`) is measured again
        twice as late; one that wins, as often as at first."""
        cost = self.costs[bucket].get(num_draft_tokens)
        if cost is None:
            return
        best = self._best_measured(bucket, expected)
        won = best == num_draft_tokens
        cost.refresh = REFRESH_STEPS if won else min(cost.refresh * 2, MAX_REFRESH_STEPS)
        cost.lost_checks = 0 if won else cost.lost_checks + 1
        cost.recheck = cost.recheck and 0 < cost.lost_checks < CONFIRMING_CHECKS  # the loss confirmed soon too

    def _best_measured(self, bucket: int, expected: dict[int, float]) -> int | None:
        """The measured candidate with the most tokens per second for a batch making `expected` tokens a step."""
        table = self.costs.get(bucket, {})
        scored = [(expected[k] / c.seconds, k) for k, c in table.items() if c.samples >= MIN_SAMPLES]
        if not scored:
            return None
        return max(scored, key=lambda s: (s[0], s[1]))[1]  # ties: the larger k (the configured behaviour)

    def _best(self, bucket: int, expected: dict[int, float]) -> int:
        """The k this batch exploits at the bucket, for its acceptance (`expected`): the best measured one, unless
        the current one is within the hysteresis of it."""
        best = self._best_measured(bucket, expected)
        current = self._current.get(bucket)
        if not self.judged:  # too few verify steps to judge drafting on: the configured k
            best = self.configured
        elif best is None:  # nothing measured here yet: the configured k, unless the acceptance rules drafting out
            adds_nothing = self._adds_too_little(self.configured, expected[self.configured])
            best = 0 if 0 in self.num_steps and adds_nothing else self.configured
        elif current is not None and current != best and current in self.costs[bucket]:
            table = self.costs[bucket]
            kept, other = expected[current] / table[current].seconds, expected[best] / table[best].seconds
            if other < kept * (1 + HYSTERESIS):
                best = current
            elif self.plans[bucket] - table[best].sampled_at > FRESH_STEPS:  # priced long ago: checked first
                if self.plans[bucket] < self._retry_at.get((bucket, best), 0):  # its check found no steady step
                    return current
                self._check(bucket, best, table[best].samples)
                return best
        if best != current:
            self._switch(bucket, current)
        self._current[bucket] = best
        return best

    def _switch(self, bucket: int, left: int | None) -> None:
        """The bucket leaves `left`: it is checked again soon (`recheck`), until CONFIRMING_CHECKS checks confirm the
        loss or it wins back. Its price may have been raised by a stall while it ran; a request's rate that fell may
        have been a few unlucky steps (at k = 0 it verifies nothing, so only a check corrects it)."""
        old = self.costs[bucket].get(left) if left is not None else None
        if old is not None:
            old.recheck, old.lost_checks = True, 0

    @property
    def judged(self) -> bool:
        """Whether MIN_JUDGED verified request-steps were seen, so that drafting may be judged on its acceptance
        (nothing to judge without a drafting candidate)."""
        return self.accepted.depths == 0 or self.accepted.evidence >= MIN_JUDGED

    def measured(self, batch: int) -> bool:
        """Whether every candidate's cost at this batch's bucket is measured and none is under test: what a
        server that has served such batches a while knows (benchmarks warm up until then). A hopeless candidate's
        test does not count: the engine leaves it unfinished when it releases the batch from the drafter and plans
        without this model (drafter_release.py)."""
        bucket = self.bucket(batch)
        table = self.costs.get(bucket, {})
        compared = all((k in table and table[k].samples >= MIN_SAMPLES) or self._hopeless(k) for k in self.candidates)
        exploring = self._exploring.get(bucket)
        return compared and (exploring is None or self._hopeless(exploring.num_draft_tokens))

    def describe(self) -> dict[str, object]:
        """What it measured and chose (benchmarks and logs): the acceptance is the global one; `step_ms` each price,
        and of k = 0's the share that is the held context's flushes (`k0_flush_ms`, per k = 0 step)."""
        return {
            "chosen_k_steps": dict(sorted(self.chosen.items())),
            "acceptance_per_depth": [round(self.acceptance(d), 4) for d in range(1, self.accepted.depths + 1)],
            "tracked_requests": self.tracked_requests,
            "traffic_requests": self.traffic_requests,
            "step_ms": {
                bucket: {k: round(c.seconds * 1e3, 4) for k, c in sorted(table.items())}
                for bucket, table in sorted(self.costs.items())
            },
            "k0_flush_ms": {
                bucket: round((table[0].seconds - table[0].plain) * 1e3, 4)
                for bucket, table in sorted(self.costs.items())
                if 0 in table
            },
        }
