"""What the chain's and the tree's device steps share about sampling: a batch's variant (greedy, sampled, sorted,
and those two with penalties and logprobs), its per-request sampling inputs, the penalty table, and one set of
captured graphs per variant.

A greedy batch's graph reads the argmax alone, as before sampled requests could take the device step; a batch
with a sampled request replays the sampled graph, which also verifies its greedy requests by the greedy rule
(verifier.py), so a mixed batch stays on the device. A batch where some request sets a penalty or asks for
logprobs replays an extras graph: every row penalised from the table (requests without penalties read the
scratch slot), and the raw logprobs of every emitted token read back with the tokens (device_penalties.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from executor_service.engine.request import Request
from executor_service.models.attention_step import AttentionStep
from executor_service.runner.cuda_graphs import StepGraphs
from executor_service.runner.step_constants import StepConstants
from executor_service.sample.device_sampling import (
    GREEDY,
    SAMPLING_INPUTS,
    VARIANTS,
    SamplingTensors,
    has_extras,
    step_variant,
)
from executor_service.spec_decode.device_penalties import (
    PenaltyTable,
    count_emitted,
    emitted_logprobs,
    logprob_width,
    penalty_inputs,
    penalty_params,
)
from executor_service.spec_decode.verifier import StepPenalties, Verdict

# Per-request inputs of an extras variant: the penalty slot (-1: none) and (repetition, presence, frequency).
EXTRA_INPUTS = {"slot": ((), torch.int64, -1), "penalty": ((3,), torch.float32, 0)}
DEFAULT_PENALTY_SLOTS = 64


@dataclass(frozen=True)
class StepSampling:
    """A batch's variant and the inputs its step reads besides the tokens (none for a greedy batch)."""

    variant: str = GREEDY
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, requests: list[Request], table: PenaltyTable) -> StepSampling:
        variant = step_variant([r.settings for r in requests], table.vocab)
        if variant == GREEDY:
            return cls()
        device = table.device
        sampling = SamplingTensors.build([r.settings for r in requests], [r.seed for r in requests], device)
        if not has_extras(variant):
            return cls(variant, sampling.inputs())
        slot, penalty = penalty_inputs(table.slots_of(requests), penalty_params(requests), device)
        return cls(variant, sampling.inputs() | {"slot": slot, "penalty": penalty})


def capture_variants(
    build: Callable[[str, dict], StepGraphs], base_inputs: dict, sampled_inputs: dict | None = None
) -> dict[str, StepGraphs]:
    """One StepGraphs per variant, captured: `build(variant, request_inputs)` makes each. `sampled_inputs`: what
    the variants other than greedy read besides the sampling settings (drafts drawn from q: their q). The variants
    capture into one memory pool, as one StepGraphs' buckets do: a step replays one graph at a time and its
    outputs are read (copied to the host, or into the next step's inputs) before another replays, so their
    temporaries can share memory (an 8B target's five variants at batch 32 would keep ~3.7 GiB apart, ~1.2
    GiB shared, by their CPU allocation peaks)."""
    graphs, pool = {}, None
    for variant in VARIANTS:
        inputs = base_inputs if variant == GREEDY else base_inputs | SAMPLING_INPUTS | (sampled_inputs or {})
        if has_extras(variant):
            inputs = inputs | EXTRA_INPUTS
        graphs[variant] = build(variant, inputs)
        graphs[variant].capture(pool)
        pool = graphs[variant].pool  # a failed capture's retry moved to a fresh pool: the next ones follow it
    return graphs


class VariantSteps:
    """The run of a device step (spec_step.py): its variant's graph when the batch fits one, else its
    `forward` eagerly; `counts` by variant and by graph / eager (benchmarks and tests read them)."""

    def __init__(self, vocab: int, device: torch.device, penalty_slots: int = DEFAULT_PENALTY_SLOTS) -> None:
        self.graphs: dict[str, StepGraphs] = {}
        self.counts: Counter[str] = Counter()
        self.table = PenaltyTable(penalty_slots, vocab, device)  # allocated when first needed (or captured)
        self.logprob_top = logprob_width(vocab)

    def fits(self, requests: list[Request]) -> bool:
        """Whether the penalised requests of a batch all have a slot of the penalty table, or can get one."""
        return self.table.fits(requests)

    def step_penalties(self, x: dict[str, torch.Tensor]) -> StepPenalties | None:
        """An extras variant's penalties (the table allocated: its graphs read it)."""
        if "slot" not in x:
            return None
        self.table.allocate()
        return StepPenalties(self.table, x["slot"], x["penalty"], self.table.bias_rows(x["slot"]))

    def extras(
        self,
        raw_logits: torch.Tensor,
        verdict: Verdict,
        penalties: StepPenalties | None,
        constants: StepConstants,
        rows: int,
    ) -> list[torch.Tensor]:
        """An extras variant's work after verification: count the emitted tokens in their slots, and the packed
        logprobs of every emitted token (device_penalties.emitted_logprobs) to read back. `rows`: each request's
        verify rows."""
        if penalties is None:
            return []
        count, width = verdict.emitted.shape
        count_emitted(penalties.table, penalties.slot, verdict.emitted, verdict.accepted, constants.arange(width))
        flat = constants.strided(count, rows)[:, None] + verdict.path_rows
        return [emitted_logprobs(raw_logits, flat, verdict.emitted)]

    def forward(
        self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor], variant: str = GREEDY
    ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def replays(self, variant: str, graphs: StepGraphs) -> bool:
        """Whether the variant's captured graph runs this step as it is now configured (else: eagerly)."""
        return True

    def run(
        self, variant: str, kind: str, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """`kind`: "" for a step launched from host inputs, " following" for one derived on the device."""
        graphs = self.graphs.get(variant)
        self.counts[variant] += 1
        if graphs is not None and step.seq_lens.shape[0] <= graphs.max_batch and self.replays(variant, graphs):
            self.counts["graph" + kind] += 1
            return graphs.run(step.block_table, step.seq_lens, step.slot_mapping, positions, **x)
        self.counts["eager" + kind] += 1
        return self.forward(step, positions, x, variant)
