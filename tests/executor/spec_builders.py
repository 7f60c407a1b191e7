"""Sessions with a synthetic drafter, and replaying drafters for acceptance tests and benchmarks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from executor_builders import TINY, load_request

from executor_service.engine.request import Request
from executor_service.server.drafting import resolve_draft
from executor_service.server.session import EngineSettings, ModelSession, build_session
from executor_service.server.wire import resolve_target
from executor_service.spec_decode.adaptive_k import MIN_SAMPLES, AdaptiveK
from executor_service.spec_decode.drafter_release import MIN_VERIFIED
from executor_service.spec_decode.proposer import Proposer
from specdec.v1 import common_pb2, executor_pb2

METHODS = {
    "eagle": common_pb2.SPEC_METHOD_EAGLE,
    "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
    "dflash": common_pb2.SPEC_METHOD_DFLASH,
    "dflash_causal": common_pb2.SPEC_METHOD_DFLASH,
}


def draft_model(method: str, k: int, seed: int = 7, vocab_size: int = TINY["vocab_size"]) -> executor_pb2.DraftModel:
    """A synthetic drafter of the tiny target's width: EAGLE 1 layer, EAGLE-3 with a reduced vocabulary,
    DFlash 2 layers with a block of k + 1 (mask: the last id)."""
    dflash = method.startswith("dflash")
    spec = executor_pb2.SyntheticModel(
        architecture="llama", seed=seed, **{**TINY, "vocab_size": 0, "num_layers": 2 if dflash else 1}
    )
    if method == "eagle3":
        spec.draft_vocab_size = vocab_size // 2
    draft = executor_pb2.DraftModel(method=METHODS[method], num_speculative_tokens=k)
    draft.source.synthetic.CopyFrom(spec)
    if dflash:
        draft.dflash_config.mask_token_id = vocab_size - 1
        draft.dflash_config.block_size = k + 1
        draft.dflash_config.causal = method == "dflash_causal"
    return draft


def spec_session(
    method: str,
    k: int,
    backend: str = "CPU_ATTN",
    draft_backend: str | None = None,
    num_kv_blocks: int = 96,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    device: str = "cpu",
    dtype: int = common_pb2.DTYPE_FLOAT32,
    cuda_graphs: bool = True,
    vocab_size: int = TINY["vocab_size"],
    draft_seed: int = 7,
    adaptive: bool = False,
    sampled_drafts: str = "auto",
) -> ModelSession:
    """A warmed-up speculative session, engine thread not started (tests drive run_until_idle). `adaptive`:
    each step's k from measured costs (off: the loaded k every step, what scripted acceptance tests count);
    `sampled_drafts`: EngineSettings' (drafts drawn from q: "on", before the graphs are captured)."""
    request = load_request(backend=backend, num_kv_blocks=num_kv_blocks)
    request.target.synthetic.vocab_size = vocab_size
    request.dtype = dtype
    request.draft.CopyFrom(draft_model(method, k, draft_seed, vocab_size))
    source = resolve_target(request.target, None, "target")
    draft = resolve_draft(request.draft, source.config, None)
    settings = EngineSettings(
        max_num_batched_tokens, max_num_seqs, cuda_graphs, adaptive_speculation=adaptive, sampled_drafts=sampled_drafts
    )
    return build_session(
        source,
        request,
        common_pb2.BackendDecision(backend=backend),
        torch.device(device),
        settings,
        start=False,
        draft=draft,
        draft_decision=common_pb2.BackendDecision(backend=draft_backend or backend),
    )


class ReplayDrafts:
    """A test drafter: proposes the target's own continuation (known in advance), with the draft at
    `wrong_at` corrupted, so every verify step accepts exactly `wrong_at` drafts (None: all of them)."""

    def __init__(self, references: dict[str, list[int]], vocab_size: int, wrong_at: int | None = None) -> None:
        self.references, self.vocab_size, self.wrong_at = references, vocab_size, wrong_at

    def __call__(self, request: Request, drafts: list[int]) -> list[int]:
        done = len(request.output_ids)
        upcoming = self.references[request.request_id][done : done + len(drafts)]
        upcoming += [0] * (len(drafts) - len(upcoming))
        if self.wrong_at is not None and self.wrong_at < len(upcoming):
            upcoming[self.wrong_at] = (upcoming[self.wrong_at] + 1) % self.vocab_size
        return upcoming


class EchoDrafts:
    """The always-right drafter over an echoing target (executor_service.models.weights.echoing_target, whose greedy
    next token is its newest): every draft is the request's newest token, whatever k the step takes. Set as the
    proposer's `replay` on the process that drafts (rank 0 under tensor parallelism: the other ranks never draft).
    bench/specdec_bench.py's adaptive part and bench/tp_bench.py --drafts always-right use it."""

    def __call__(self, request: Request, drafts: list[int]) -> list[int]:
        newest = request.output_ids[-1] if request.output_ids else request.prompt_ids[-1]
        return [newest] * len(drafts)

    @staticmethod
    def on_device(bonus: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The same rule inside the device step (Proposer.device_replay): the newest token is the step's bonus."""
        return bonus[:, None].expand_as(drafts)

    def install(self, proposer: Proposer) -> None:
        """On the host path and in the device step, so steps launch ahead as a drafter's do (set before the
        device step's graphs are captured, or they are not replayed)."""
        proposer.replay, proposer.device_replay = self, self.on_device


class Scripted(AdaptiveK):
    """Plans a fixed cycle of k values, whatever it measures (the switches a real model makes, forced); it still
    records what the engine measures. `releases`: its measured acceptance may rule drafting out, and the engine then
    releases requests from the drafter (drafter_release.py) and plans k = 0 without it; off, the cycle holds."""

    def __init__(self, cycle: list[int], candidates: list[int], releases: bool = False) -> None:
        super().__init__(candidates)
        self.cycle = itertools.cycle(cycle)
        self.releases = releases

    def drafting_ruled_out(self, min_verified: float) -> bool:
        return self.releases and super().drafting_ruled_out(min_verified)

    def drafting_loses(self, batch: int, min_verified: float) -> bool:
        return self.releases and super().drafting_loses(batch, min_verified)

    def plan(self, request_ids: Sequence[str], undrafted: int = 0) -> int:
        k = next(self.cycle)
        self.chosen[k] += 1
        self.last_planned = k
        return k


class Priced(AdaptiveK):
    """The engine's cost model with given step prices (seconds per step by k) in place of the CPU's measured times,
    whose noise would make the plans vary: measured at every bucket up to batch 8 before the run (nothing left to
    test), and each steady step recorded at its k's price (the held context's flushes add nothing). `global_only`:
    the batch planned as requests without history of their own (the global acceptance alone)."""

    def __init__(self, prices: dict[int, float], global_only: bool = False) -> None:
        super().__init__(prices, configured=max(prices))
        self.prices, self.global_only = prices, global_only
        # each plan's running requests, k, and whether drafting could be judged (`judged`)
        self.planned: list[tuple[tuple[str, ...], int, bool]] = []
        for batch in (1, 2, 4, 8):
            for k, seconds in prices.items():
                for _ in range(MIN_SAMPLES + 1):  # the warm-up, then enough samples
                    super().record(batch, k, seconds)

    def record(self, batch: int, num_draft_tokens: int, seconds: float) -> None:
        super().record(batch, num_draft_tokens, self.prices[num_draft_tokens])

    def record_deferred(self, batch: int, seconds: float, steps: int, landed: int) -> None:
        return

    def plan(self, request_ids: Sequence[str], undrafted: int = 0) -> int:
        planned = [f"newcomer{i}" for i in range(len(request_ids))] if self.global_only else request_ids
        judged = self.judged
        k = super().plan(planned, undrafted)
        self.planned.append((tuple(request_ids), k, judged))
        return k


def rule_out(speculation: AdaptiveK | None) -> None:
    """Acceptance measured at nothing over twice MIN_VERIFIED request-steps, at every depth, of requests that have
    finished since (their own counts forgotten): every drafting k is hopeless, and the engine releases requests
    from the drafter (drafter_release.py) where the model lets it."""
    assert speculation is not None
    count, depth = 2 * MIN_VERIFIED, max(speculation.num_steps.values())
    past = [f"past{i}" for i in range(count)]
    speculation.observe_verify(past, [depth] * count, [0] * count)
    for request_id in past:
        speculation.forget_request(request_id)
    assert AdaptiveK.drafting_ruled_out(speculation, MIN_VERIFIED)
