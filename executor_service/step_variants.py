"""What the chain's and the tree's device steps share about sampling: a batch's variant (greedy, sampled, sorted),
its per-request sampling inputs, and one set of captured graphs per variant.

A greedy batch's graph reads the argmax alone, as before sampled requests could take the device step; a batch
with a sampled request replays the sampled graph, which also verifies its greedy requests by the greedy rule
(verifier.py), so a mixed batch stays on the device."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from executor_service.attention_step import AttentionStep
from executor_service.cuda_graphs import StepGraphs
from executor_service.device_sampling import GREEDY, SAMPLING_INPUTS, VARIANTS, SamplingTensors, step_variant
from executor_service.request import Request


@dataclass(frozen=True)
class StepSampling:
    """A batch's variant and the inputs its step reads besides the tokens (none for a greedy batch)."""

    variant: str = GREEDY
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, requests: list[Request], vocab: int, device: torch.device) -> StepSampling:
        variant = step_variant([r.settings for r in requests], vocab)
        if variant == GREEDY:
            return cls()
        sampling = SamplingTensors.build([r.settings for r in requests], [r.seed for r in requests], device)
        return cls(variant, sampling.inputs())


def takes(request: Request) -> bool:
    """Whether a request's sampling runs on the device step: greedy or sampled, without penalties or logprobs."""
    return not request.settings.has_penalties and request.settings.logprobs is None


def capture_variants(build: Callable[[str, dict], StepGraphs], base_inputs: dict) -> dict[str, StepGraphs]:
    """One StepGraphs per variant, captured: `build(variant, request_inputs)` makes each."""
    graphs = {}
    for variant in VARIANTS:
        inputs = base_inputs if variant == GREEDY else base_inputs | SAMPLING_INPUTS
        graphs[variant] = build(variant, inputs)
        graphs[variant].capture()
    return graphs


class VariantSteps:
    """The run of a device step (SpecStep, TreeStep): its variant's graph when the batch fits one, else its
    `forward` eagerly; `counts` by variant and by graph / eager (benchmarks and tests read them)."""

    def __init__(self) -> None:
        self.graphs: dict[str, StepGraphs] = {}
        self.counts: Counter[str] = Counter()

    def forward(
        self, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor], variant: str = GREEDY
    ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def run(
        self, variant: str, kind: str, step: AttentionStep, positions: torch.Tensor, x: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """`kind`: "" for a step launched from host inputs, " following" for one derived on the device."""
        graphs = self.graphs.get(variant)
        self.counts[variant] += 1
        if graphs is not None and step.seq_lens.shape[0] <= graphs.max_batch:
            self.counts["graph" + kind] += 1
            return graphs.run(step.block_table, step.seq_lens, step.slot_mapping, positions, **x)
        self.counts["eager" + kind] += 1
        return self.forward(step, positions, x, variant)
