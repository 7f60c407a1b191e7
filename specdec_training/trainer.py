"""The training loop: AdamW, warmup then cosine decay, bf16 autocast on GPUs (fp32 on the CPU), gradient
clipping, a progress bar, and checkpoints that make a run resumable and deterministic.

Everything random is drawn from the seed: the drafter's initial weights, each epoch's order of the
sequences (a generator seeded with seed and epoch, so step s always trains on the same batch), and
DFlash's anchors (one generator whose state is checkpointed). A run stopped at any checkpoint and
resumed therefore ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from executor_service.models.draft_models import DFlashDrafter, Drafter, Eagle3Drafter
from executor_service.models.model import DecoderModel
from specdec_training.features import TEACHER_TOP_K, Sequence, collate, target_view
from specdec_training.losses import drafter_loss, read_metrics
from specdec_training.progress import Progress
from specdec_training.recipes import Recipe

WARMUP_STEPS, TIMING_STEPS = 10, 20  # a time budget first fixes the run's length from steps 10-30's pace
REFIT_STEPS = 100  # then fits it again every this many steps, at their pace (runs sharing a GPU speed up as
# the others finish: the first fit alone cut a concurrent 18-minute run to 7 minutes)
LENGTH_WINDOW_BATCHES = 64  # batches of sequences sorted by length together (see Trainer._epoch_batches)
# A batch's width is rounded up to a multiple of this. On an H100, SDPA's cuDNN attention builds a plan for
# every new shape, forward and backward; EAGLE-3's unrolled steps attend over 1..7 times the width. Over text of
# mixed lengths (bench/train_profile.py --mixed-lengths, batch 32) a step took 0.77 s at exact widths and 0.14 s
# at multiples of 64, once each width's plans were built (0.14 s without cuDNN at all).
PAD_MULTIPLE = 64
EVAL_SEED_OFFSET = 7_777  # DFlash anchors of evaluations: a fixed draw, the same before and after training


@dataclass
class TrainOutcome:
    steps: int
    seconds: float
    final: dict[str, float]  # train metrics, averaged over the last `log_every` steps
    history: list[dict[str, float]] = field(default_factory=list)  # averaged every `log_every` steps


class Trainer:
    def __init__(
        self,
        drafter: Drafter,
        target: DecoderModel,
        sequences: list[Sequence],
        recipe: Recipe,
        seed: int,
        device: torch.device,
        t2d: torch.Tensor | None = None,
        progress: bool = True,
        pad_multiple: int = PAD_MULTIPLE,
    ) -> None:
        self.drafter, self.target, self.sequences, self.recipe = drafter, target, sequences, recipe
        self.seed, self.device, self.t2d, self.progress = seed, device, t2d, progress
        self.pad_multiple = pad_multiple
        self.batches_per_epoch = math.ceil(len(sequences) / recipe.batch_size)
        self.total_steps = max(1, math.ceil(recipe.epochs * self.batches_per_epoch))
        decay = [p for p in drafter.parameters() if p.dim() >= 2]  # matrices; not norms and biases
        other = [p for p in drafter.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=recipe.lr,
            betas=(0.9, 0.95),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.window: dict[str, list[float]] = defaultdict(list)  # metrics since the last history entry
        self.seconds = 0.0
        self.time_budget: float | None = None  # seconds: the run is shortened to fit (see fit_to_budget)
        self.step_cap: int | None = None  # the recipe's (or --max-steps') total, once a fit has changed it
        self._orders: dict[int, list[list[int]]] = {}  # the current epoch's batches (sequence indices)
        # When the recipe distills, the target's distribution is computed with the labels: over EAGLE-3's draft
        # vocabulary (its target ids), or DFlash's top-K teacher (the drafter scores the whole vocabulary).
        distills = recipe.loss.distill > 0
        self.soft_ids = drafter.target_ids() if distills and isinstance(drafter, Eagle3Drafter) else None
        self.teacher_k = TEACHER_TOP_K if distills and isinstance(drafter, DFlashDrafter) else 0

    def _lr_factor(self, step: int) -> float:
        warmup = max(1, round(self.recipe.warmup_ratio * self.total_steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total_steps - warmup)
        floor = self.recipe.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def batch(self, step: int) -> list[Sequence]:
        epoch, index = divmod(step, self.batches_per_epoch)
        if epoch not in self._orders:
            self._orders = {epoch: self._epoch_batches(epoch)}
        return [self.sequences[i] for i in self._orders[epoch][index]]

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """One epoch's batches, of sequences of similar length: a batch is padded to its longest row, and
        random batches of sequences from 40 to 1024 tokens spent most of a step on padding. The epoch's
        random order is cut into windows of LENGTH_WINDOW_BATCHES batches, each window sorted by length and
        cut into batches, then the batches are shuffled: which sequences meet stays random, their lengths
        close. Every sequence is seen once per epoch; the order is a function of the seed and the epoch."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.sequences), generator=generator).tolist()
        size, limit = self.recipe.batch_size, self.recipe.max_len
        window = size * LENGTH_WINDOW_BATCHES
        batches = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start : start + window], key=lambda i: min(len(self.sequences[i].ids), limit))
            batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        shuffle = torch.randperm(len(batches), generator=generator).tolist()
        return [batches[i] for i in shuffle]

    def _autocast(self) -> Any:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    def train_step(self, mark: Callable[[str], None] | None = None) -> dict[str, float]:
        """One step; `mark` (bench/train_profile.py) is called with each part's name as it is queued."""
        mark = mark or (lambda _part: None)
        batch = collate(self.batch(self.step), self.recipe.max_len, self.device, self.pad_multiple)
        view = target_view(self.target, self.drafter.config, batch, self.soft_ids, self.teacher_k)
        mark("target_view")
        with self._autocast():
            out = drafter_loss(self.drafter, view, self.recipe.loss, self.generator, self.t2d)
        mark("loss_forward")
        out.loss.backward()
        mark("backward")
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.recipe.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        mark("optimizer")
        self.step += 1
        metrics = read_metrics({**out.values, "grad_norm": norm})  # the step's one read back
        return {**metrics, "lr": self.scheduler.get_last_lr()[0]}

    def run(
        self, checkpoint: Path | None = None, every: int = 0, stop_after: int | None = None, log_every: int = 10
    ) -> TrainOutcome:
        """Train to the recipe's last step (or `stop_after` more steps), saving `checkpoint` every `every`
        steps and at the end."""
        limit = self.step + stop_after if stop_after is not None else math.inf
        last = min(self.total_steps, limit)
        bar = Progress(self.total_steps, f"training {self.drafter.config.method}", "step", self.step, self.progress)
        started = time.perf_counter()
        paced_from = (self.step, started)  # the step and time the pace is measured from
        while self.step < last:
            if self.step == WARMUP_STEPS:
                paced_from = (self.step, time.perf_counter())
            if self.time_budget is not None and self._fit_due() and self.step > paced_from[0]:
                now = time.perf_counter()
                per_step = (now - paced_from[1]) / (self.step - paced_from[0])
                last = min(self.fit_to_budget(self.seconds + now - started, per_step), limit)
                paced_from = (self.step, now)
            metrics = self.train_step()
            for name, value in metrics.items():
                self.window[name].append(value)
            bar.update(1, loss=metrics["loss"], accept=metrics["accept_length"])
            if self.step % log_every == 0 or self.step == self.total_steps:
                self.history.append({"step": self.step, **{k: sum(v) / len(v) for k, v in self.window.items()}})
                self.window.clear()
            if checkpoint is not None and ((every and self.step % every == 0) or self.step == last):
                self.seconds += time.perf_counter() - started
                started = time.perf_counter()
                self.save(checkpoint)
        bar.close()
        self.seconds += time.perf_counter() - started
        final = {k: v for k, v in self.history[-1].items() if k != "step"} if self.history else {}
        return TrainOutcome(self.step, self.seconds, final, self.history)

    def _fit_due(self) -> bool:
        first = WARMUP_STEPS + TIMING_STEPS
        return self.step == first or (self.step > first and (self.step - first) % REFIT_STEPS == 0)

    def fit_to_budget(self, elapsed: float, per_step: float) -> int:
        """As many steps as the time budget holds at `per_step` seconds (timed after the warm-up steps, whose
        compiling would make the run far too short), never more than the recipe's; the learning-rate schedule
        stretches over them. Returns the new total."""
        assert self.time_budget is not None
        if self.step_cap is None:
            self.step_cap = self.total_steps
        fits = self.step + int(max(0.0, self.time_budget - elapsed) / per_step)
        self.total_steps = max(self.step + 1, min(self.step_cap, fits))
        return self.total_steps

    @torch.no_grad()
    def evaluate(self, sequences: list[Sequence]) -> dict[str, float]:
        """Mean metrics over `sequences` (batches of the recipe's size), with a fixed anchor draw."""
        generator = torch.Generator().manual_seed(self.seed + EVAL_SEED_OFFSET)
        totals: dict[str, float] = defaultdict(float)
        size = self.recipe.batch_size
        batches = [sequences[i : i + size] for i in range(0, len(sequences), size)]
        for chunk in batches:
            batch = collate(chunk, self.recipe.max_len, self.device, self.pad_multiple)
            view = target_view(self.target, self.drafter.config, batch, self.soft_ids, self.teacher_k)
            with self._autocast():
                out = drafter_loss(self.drafter, view, self.recipe.loss, generator, self.t2d)
            for name, value in out.metrics.items():
                totals[name] += value * len(chunk)
        return {name: value / len(sequences) for name, value in totals.items()}

    def state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seed": self.seed,
            "recipe": asdict(self.recipe),
            "drafter": self.drafter.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
            "history": self.history,
            "window": dict(self.window),
            "seconds": self.seconds,
            "total_steps": self.total_steps,
            "step_cap": self.step_cap,
        }

    def save(self, path: Path) -> None:
        """Written beside and renamed, so an interrupted save leaves the previous checkpoint whole."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(self.state(), partial)
        os.replace(partial, path)

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state["recipe"] != asdict(self.recipe) or state["seed"] != self.seed:
            raise ValueError(f"{path} was written by another recipe or seed: {state['recipe']}, seed {state['seed']}")
        self.drafter.load_state_dict(state["drafter"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"].cpu())
        self.step, self.history, self.seconds = state["step"], state["history"], state["seconds"]
        self.total_steps = state.get("total_steps", self.total_steps)
        self.step_cap = state.get("step_cap")
        self.window = defaultdict(list, state["window"])
