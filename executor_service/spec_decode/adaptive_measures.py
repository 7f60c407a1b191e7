"""What adaptive speculation (adaptive_k.py) measures: a step's price per (batch bucket, k), and a request's own
acceptance per depth. Each keeps what the choice of k reads worked out as its samples arrive, since `plan` runs
every step and reads them many times."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

WINDOW = 5  # recent steady step times per (bucket, k); their median is its cost
DECAY = 0.995  # per observed request-step: the acceptance counts' memory (~200 request-steps; a request's: its own)
# Pseudo-steps at the global rate in a request's own rate: without history it is the global rate. A request planned
# at k = 0 verifies nothing, so its rate stays where it fell until the bucket checks drafting again: with 4, sampled
# EAGLE-3 requests at batch 1 (T = 0.7 on the H200) fell below break-even on a few unlucky steps, ran 22 % of their
# steps at k = 0 and lost 5 % against the fixed k. Replayed on recorded acceptance (bench/adaptive_replay.py),
# 12-24 lose nothing there and keep the gain on mixed batches (penalised requests: ~1.3 tokens a step).
PRIOR = 16.0
# Verify steps of its own before a request is planned on its rate: until then it counts as accepting every draft
# (drafting is tried before it is judged, per request as MIN_JUDGED does globally). A request planned at k = 0
# verifies nothing: at batch 1 after two penalised requests the traffic's rate planned the next, whose drafts were
# all right, at k = 0 for its whole life.
TRIAL_STEPS = 2


@dataclass
class StepCost:
    """One (bucket, k)'s steady step time: the median of its recent samples, robust to the outliers a GPU step
    meets (a kernel compiled for a new shape, a capture elsewhere, another process's burst); its first steady step
    is a warm-up and not counted. Also when it was last measured. The price is worked out when a sample arrives,
    not when it is read: `plan` runs every step and reads every candidate's price several times."""

    warm_up: float
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    surcharges: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # k = 0: deferred context, a step
    flushed: bool = False  # k = 0: its first flush seen (a warm-up: it compiles the flush's row count)
    samples: int = 0  # steady steps counted, the warm-up not among them
    measured_at: int = 0  # the bucket's plan count at its last sample, or at the start of its latest check
    sampled_at: int = 0  # the bucket's plan count at its last sample
    refresh: int = 0  # plans at the bucket between its checks while it loses (AdaptiveK sets it)
    restarted: bool = False  # a check began: its first sample starts the window afresh (`restart`)
    recheck: bool = False  # the bucket left it: checked FRESH_STEPS later, whatever its interval, until confirmed
    lost_checks: int = 0  # checks in a row that found it losing since the bucket left it
    plain: float = field(init=False)  # the median of the recent samples (the warm-up's time until one is counted)
    seconds: float = field(init=False)  # the price: `plain` and, for k = 0, the deferred context's flushes per step

    def __post_init__(self) -> None:
        self._reprice()

    def add(self, seconds: float, measured_at: int) -> None:
        """A steady step's time, measured at the bucket's plan count `measured_at`."""
        if self.restarted:
            self.recent.clear()
            self.restarted = False
        self.recent.append(seconds)
        self.samples += 1
        self.measured_at = self.sampled_at = measured_at
        self._reprice()

    def restart(self) -> None:
        """A check of this candidate began: its samples replace the window's, which were measured when it last ran
        (kept until the first one comes, so a check the batch leaves unmeasured keeps the old price)."""
        self.restarted = True

    def add_surcharge(self, seconds: float) -> None:
        """k = 0: a flush of deferred context, the time it added per k = 0 step it served."""
        self.surcharges.append(seconds)
        self._reprice()

    def _reprice(self) -> None:
        self.plain = median(self.recent) if self.recent else self.warm_up
        self.seconds = self.plain + (median(self.surcharges) if self.surcharges else 0.0)


@dataclass
class RequestAcceptance:
    """One request's decayed counts per depth (index d, as the global evidence counts), and what a batch's sum of
    rates reads of them, worked out when they change: per depth its own part of its rate, reached / (tried +
    PRIOR), and the global rate's weight in it, PRIOR / (tried + PRIOR). The global rate (the traffic's: the mean
    of recent requests' shares, reached / tried) is kept out of them because it changes at every verify step: a
    batch's sum at depth d is then sum(own) + global(d) x sum(weight), and no request's figures are worked out
    again for a plan. Before TRIAL_STEPS verify steps a request is on trial and counts every draft accepted."""

    reached: list[float]
    tried: list[float]
    own: list[float]
    weight: list[float]
    verify_steps: int = 0

    @property
    def on_trial(self) -> bool:
        """Fewer than TRIAL_STEPS verify steps of its own: planned as if every draft were accepted."""
        return self.verify_steps < TRIAL_STEPS

    @classmethod
    def fresh(cls, depths: int) -> RequestAcceptance:
        """No history (on trial; after it, with no count at a depth, its rate there is the global one: weight 1)."""
        return cls([0.0] * depths, [0.0] * depths, [0.0] * depths, [1.0] * depths)

    def observe(self, depth: int, accepted: int, tried: list[float], reached: list[float]) -> None:
        """A verify step of its drafts to `depth` that accepted `accepted` of them, counted in its counts and in the
        global evidence (`tried`, `reached`) in one loop: it runs for every verified request of every step (at batch
        256, depth 7, on the CPU host: ~0.3 ms a step, ~0.4 ms in two loops; the global counts alone took ~0.14)."""
        own_tried, own_reached, own, weight = self.tried, self.reached, self.own, self.weight
        self.verify_steps += 1
        for d in range(1, depth + 1):
            hit = 1.0 if accepted >= d else 0.0
            tried[d] = tried[d] * DECAY + 1.0
            reached[d] = reached[d] * DECAY + hit
            steps = own_tried[d] = own_tried[d] * DECAY + 1.0
            scale = 1.0 / (steps + PRIOR)
            own_reached[d] = own_reached[d] * DECAY + hit
            own[d] = own_reached[d] * scale
            weight[d] = PRIOR * scale
