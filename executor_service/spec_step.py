"""The speculative step on the device for chains: verify, accept and propose in one pass, read back once.

When every request of a step verifies all k of its drafts (the steady state of speculative decoding), greedy or
sampled, nothing between the target's verify pass and the drafter's next proposal needs the host:

- verify and accept (`verifier.verify`, the chain as a tree whose draft j has parent j - 1): the greedy rule
  accepts drafts equal to the target's argmax, the sampled rule accepts draft d with probability p(d) and draws
  the token after a rejection from p less d (counter-based draws: device_sampling.py);
- roll back (`VerifiedStep.kept_rows`): the rejected drafts' K/V stays in the cache but is not booked, and the
  next step overwrites it; `launch_following` derives the same on the device;
- propose (`Proposer.propose_verified`): the drafter's next inputs are the emitted tokens, its newest verified
  row is row `accepted`, and each chain step's (or the DFlash block's) metadata is advanced on the device from
  that position and the slots ahead of it, which the host lays out before the step.

So the three run as one function, captured as CUDA graphs per sampling variant and batch bucket
(step_variants.py): one replay per step and one read-back of [emitted tokens, accepted count, next drafts] per
request. Penalties and logprobs run in the step too (the extras variants: device_penalties.py), the logprobs
read back with the tokens. The same function runs eagerly on the CPU and for batches larger than the graphs.
The engine's host path (verify_on_host, Proposer.propose) takes requests with q-drawn drafts, uneven batches and
penalised requests past the penalty table's slots. CUDA-graph plumbing (static buffers, buckets, capture and
replay) is cuda_graphs.StepGraphs'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from executor_service.attention_step import AttentionStep
from executor_service.cuda_graphs import StepGraphs
from executor_service.device_penalties import unpack_logprobs
from executor_service.device_sampling import GREEDY, SamplingTensors, has_extras, sorts
from executor_service.logprobs import TokenLogprob
from executor_service.model_runner import ModelRunner, StepInputs
from executor_service.parallel.graphs import lockstep_for
from executor_service.proposer import Proposer
from executor_service.request import Request
from executor_service.step_constants import StepConstants
from executor_service.step_variants import DEFAULT_PENALTY_SLOTS, StepSampling, VariantSteps, capture_variants
from executor_service.verifier import DraftLayout, verify


@dataclass(frozen=True)
class VerifiedStep:
    """What the host reads back of one device-resident step, per request."""

    target_ids: list[list[int]]  # the emitted tokens: the accepted drafts, then the token after them (k + 1 wide)
    accepted: list[int]  # drafts accepted
    next_drafts: list[list[int]]  # the drafter's k drafts for the next step
    logprobs: torch.Tensor | None = None  # an extras step's packed logprobs [B, ...] (device_penalties.py)
    logprob_top: int = 0
    penalised: list[bool] = field(default_factory=list)

    def emitted(self, index: int) -> list[int]:
        """The accepted drafts and the token after them."""
        return self.target_ids[index][: self.kept_rows(index)]

    def kept_rows(self, index: int) -> int:
        """Roll back: of the k + 1 rows verified, the request keeps its last token's and its accepted drafts';
        the rejected drafts' K/V is not counted, and the next step writes over it."""
        return self.accepted[index] + 1

    def token_logprobs(self, index: int, n: int | None) -> list[TokenLogprob] | None:
        """The emitted tokens' logprobs with the top n (None: the request asks for none)."""
        if n is None or self.logprobs is None:
            return None
        return unpack_logprobs(self.logprobs[index], self.emitted(index), self.logprob_top, n)


class PendingStep:
    """A launched step's packed result [B, (k + 1) + 1 + k], copied to pinned host memory behind the step;
    its packed result, positions and sampling inputs stay on the device for the step launched after it
    (`launch_following`). An extras step's packed logprobs (rows x (1 + 2 top) columns) end each row."""

    def __init__(
        self,
        packed: torch.Tensor,
        positions: torch.Tensor,
        rows: int,
        sampling: StepSampling | None = None,
        logprob_top: int = 0,
    ) -> None:
        self.packed, self.positions, self.sampling = packed, positions, sampling or StepSampling()
        self.rows, self.width = rows, packed.shape[1]
        self.logprob_top = logprob_top if has_extras(self.sampling.variant) else 0
        self.logprob_width = rows * (1 + 2 * logprob_top) if self.logprob_top else 0
        self.done: torch.cuda.Event | None = None
        if packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = packed

    def result(self) -> VerifiedStep:
        """Waits for the device (CUDA event synchronize releases the GIL: the gRPC loop streams meanwhile)."""
        if self.done is not None:
            self.done.synchronize()
        end = self.width - self.logprob_width
        per_request = self.host[:, :end].tolist()
        rows = self.rows
        return VerifiedStep(
            target_ids=[r[:rows] for r in per_request],
            accepted=[r[rows] for r in per_request],
            next_drafts=[r[rows + 1 :] for r in per_request],
            logprobs=self.host[:, end:] if self.logprob_width else None,
            logprob_top=self.logprob_top,
        )


class SpecStep(VariantSteps):
    def __init__(self, runner: ModelRunner, proposer: Proposer, penalty_slots: int = DEFAULT_PENALTY_SLOTS) -> None:
        super().__init__(runner.model.config.vocab_size, runner.device, penalty_slots)
        self.runner, self.proposer, self.k = runner, proposer, proposer.k
        self.constants = StepConstants(runner.device)

    def accepts(self, inputs: StepInputs, requests: list[Request]) -> bool:
        """Every request verifies k drafts (all rows sampled), greedy or sampled with argmax drafts, penalised or
        not: a request with drafts drawn from q (or a penalty past the table's slots) takes the host path, and the
        whole step with it."""
        point_masses = all(r.draft_probs is None for r in requests)
        return inputs.uniform_query_len == self.k + 1 and point_masses and self.fits(requests)

    @torch.inference_mode()
    def launch(self, inputs: StepInputs, requests: list[Request]) -> PendingStep:
        """Queue the step on the device and its read-back; returns without waiting for either."""
        starts = [r.num_computed_tokens for r in requests]  # the first verify row's position
        ahead = self.proposer.slots_ahead(requests, starts, self.proposer.ahead_width)
        step = inputs.attention
        sampling = StepSampling.of(requests, self.table)
        x = {"input_ids": inputs.input_ids, "slots_ahead": ahead, **sampling.inputs}
        (packed,) = self.run(sampling.variant, "", step, inputs.positions, x)
        return PendingStep(packed, inputs.positions, self.k + 1, sampling, self.logprob_top)

    def reach(self, request: Request) -> int:
        """Positions a request must have room for before the step after its current one is launched blind:
        this step may accept all k drafts, and the next one writes k + 1 rows and the drafter's lookahead."""
        return request.num_computed_tokens + 2 * (self.k + 1) + self.proposer.config.positions_ahead

    @torch.inference_mode()
    def launch_following(self, previous: PendingStep, requests: list[Request]) -> PendingStep:
        """Queue the step after `previous` for the same requests before the host has read `previous` back: its
        inputs (the bonus token and the next drafts), positions, sequence lengths and slots follow on the device
        from `previous`'s accepted counts. The caller has reserved every request's blocks up to `reach`."""
        rows, width = self.k + 1, self.proposer.ahead_width
        count = len(requests)
        starts = [r.num_computed_tokens for r in requests]  # `previous`'s first verify row (not yet booked)
        wide = self.proposer.slots_ahead(requests, starts, rows + width)  # from there, whatever is accepted
        block_table = self.proposer.block_table(requests)
        packed = previous.packed
        accepted = packed[:, rows]
        first = previous.positions.view(count, rows)[:, 0] + accepted + 1
        offsets = self.constants.arange(width)[None, :] + (accepted + 1)[:, None]
        next_drafts = packed[:, rows + 1 : rows + 1 + self.k]
        input_ids = torch.cat([packed[:, :rows].gather(1, accepted[:, None]), next_drafts], dim=1)
        positions = (first[:, None] + self.constants.arange(rows)[None, :]).reshape(-1)
        step = AttentionStep(
            backend=self.runner.backend, block_table=block_table,
            query_start_loc=self.constants.starts(count, rows),
            seq_lens=(first + rows).to(torch.int32), slot_mapping=wide.gather(1, offsets[:, :rows]).reshape(-1),
            max_query_len=rows, max_seq_len=max(starts) + 2 * rows,
        )  # fmt: skip
        sampling = previous.sampling
        x = {"input_ids": input_ids.reshape(-1), "slots_ahead": wide.gather(1, offsets), **sampling.inputs}
        (out,) = self.run(sampling.variant, " following", step, positions, x)
        return PendingStep(out, positions, rows, sampling, self.logprob_top)

    def forward(
        self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor], variant: str = GREEDY
    ) -> tuple:
        """[B, (k + 1) + 1 + k]: the emitted tokens (the accepted drafts, then the target's next token; past
        them, the target's argmax or the drafts), the accepted count and the next drafts of each request."""
        input_ids, ahead = x["input_ids"], x["slots_ahead"]
        count, rows = ahead.shape[0], self.k + 1
        logits, features = self.runner.forward(input_ids, positions, step, None)  # the target's pass
        assert features is not None, "a drafter reads the target's features"
        parents = self.constants.get(("chain", self.k), lambda: self.constants.arange(self.k) - 1)
        drafts = input_ids.view(count, rows)[:, 1:]
        layout = DraftLayout(drafts, parents.expand(count, -1), None, None, self.k, chain=True)
        roots = positions.view(count, rows)[:, 0]
        sampling, penalties = SamplingTensors.from_inputs(x), self.step_penalties(x)
        verdict = verify(logits, layout, sampling, roots, sorts(variant), self.constants, penalties)
        accepted = verdict.accepted
        extras = self.extras(logits, verdict, penalties, self.constants, rows)
        next_drafts = self.proposer.propose_verified(step, positions, verdict.emitted, features, accepted, ahead)
        return (torch.cat([verdict.emitted, accepted[:, None], next_drafts, *extras], dim=1),)

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """One graph per sampling variant and batch bucket (target and drafter backends both capture-safe: the
        session checks)."""

        def build(variant: str, request_inputs: dict) -> StepGraphs:
            return StepGraphs(
                f"speculative step (k = {self.k}, {variant})", functools.partial(self.forward, variant=variant),
                self.runner.backend, self.k + 1, max_batch, max_model_len, self.runner.block_size,
                self.runner.device, {"input_ids": ((), torch.int64)}, request_inputs=request_inputs,
                lockstep=lockstep_for(self.runner.model, self.runner.feature_layers or ()),
            )  # fmt: skip

        self.graphs = capture_variants(build, {"slots_ahead": ((self.proposer.ahead_width,), torch.int64, -1)})
